"""The search: what it drops, in which order, how it ranks, and its memory function on a real model.

The cost and memory functions here are stated in each test (the search takes them as arguments),
so a ranking is checked against numbers written down, not against another model of the step.
"""

import io
from dataclasses import dataclass, replace
from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn

from pipeckpt import PipeckptConfigError
from pipeckpt._errors import config_error
from pipeckpt.checkpointing.modes import NEVER
from pipeckpt.layout.candidates import Candidate
from pipeckpt.layout.fit import Fitted, Memory, Shapes, balance_of, memory_schedule
from pipeckpt.layout.orders import rank_orders
from pipeckpt.layout.report import progress_printer
from pipeckpt.layout.search import Ranked, search, why_lost
from pipeckpt.memory.predict import Prediction, predict_device
from pipeckpt.memory.profile import profile
from pipeckpt.memory.sharding import stage_rank_states
from pipeckpt.stages.partition import StagePlan


@dataclass(frozen=True)
class Step:
    """A cost estimate, stated: the search reads these fields of the cost model's StepEstimate."""

    step_s: float
    compute_s: float = 0.0
    recompute_s: float = 0.0
    bubble_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    engine_s: float = 0.0
    tokens_per_s_per_device: float = 0.0
    mfu: float = 0.0


NO_PREDICTION = Prediction(stages=(), step_time_s=0.0, schedule="gpipe", order_source="", chunks=1)


def layout(pp: int, dp: int = 1, chunks: int = 1, schedule: str = "gpipe") -> Candidate:
    return Candidate(pp, 1, dp, 1, schedule, 1, chunks)


def fitted(c: Candidate, peak: int) -> Fitted:
    return Fitted(c, (1,) * c.stages, (peak,) * c.pp, NO_PREDICTION)


def test_a_layout_whose_state_alone_does_not_fit_is_dropped_before_its_memory_is_asked() -> None:
    asked: List[Candidate] = []

    def memory(c: Candidate) -> Fitted:
        asked.append(c)
        return fitted(c, 10)

    small, big = layout(1), layout(2)
    found = search(
        [small, big],
        device_bytes=100,
        state=lambda c: 101 if c is small else 50,
        memory=memory,
        cost=lambda c: Step(1.0),
    )
    assert asked == [big]
    assert [d.stage for d in found.dropped] == ["state"]
    assert [r.candidate for r in found.ranked] == [big]


def test_layouts_are_ranked_by_predicted_step_time() -> None:
    times = {1: 3.0, 2: 1.0, 4: 2.0}
    found = search(
        [layout(pp) for pp in (1, 2, 4)],
        device_bytes=100,
        state=lambda c: 0,
        memory=lambda c: fitted(c, 10),
        cost=lambda c: Step(times[c.pp]),
    )
    assert [r.candidate.pp for r in found.ranked] == [2, 4, 1]


def test_at_equal_time_the_lower_peak_ranks_first() -> None:
    peaks = {1: 60, 2: 40}
    found = search(
        [layout(1), layout(2)],
        device_bytes=100,
        state=lambda c: 0,
        memory=lambda c: fitted(c, peaks[c.pp]),
        cost=lambda c: Step(1.0),
    )
    assert [r.candidate.pp for r in found.ranked] == [2, 1]


def test_a_layout_no_modes_fit_is_dropped_with_the_memory_models_reason() -> None:
    def memory(c: Candidate) -> Fitted:
        raise config_error(
            "memory budget 100 B", "no plan fits: the smallest feasible budget is 120 B", "more"
        )

    found = search([layout(2)], device_bytes=100, state=lambda c: 0, memory=memory, cost=lambda c: Step(1.0))
    assert found.ranked == ()
    assert found.dropped[0].stage == "memory"
    assert "smallest feasible budget is 120 B" in found.dropped[0].reason


def test_a_rank_whose_summed_stages_exceed_the_device_is_dropped() -> None:
    found = search(
        [layout(2)],
        device_bytes=100,
        state=lambda c: 0,
        memory=lambda c: fitted(c, 101),
        cost=lambda c: Step(1.0),
    )
    assert [d.stage for d in found.dropped] == ["memory"]


def test_nothing_fits_is_a_config_error_with_the_counts() -> None:
    found = search(
        [layout(1), layout(2)],
        device_bytes=10,
        state=lambda c: 11,
        memory=lambda c: fitted(c, 1),
        cost=lambda c: Step(1.0),
    )
    with pytest.raises(
        PipeckptConfigError, match="2 on their parameters, gradients and optimizer state alone"
    ):
        print(found.best)


def test_top_keeps_the_fastest() -> None:
    found = search(
        [layout(pp) for pp in (1, 2, 4)],
        device_bytes=100,
        state=lambda c: 0,
        memory=lambda c: fitted(c, 1),
        cost=lambda c: Step(float(c.pp)),
        top=2,
    )
    assert [r.candidate.pp for r in found.ranked] == [1, 2]


def test_why_the_runner_up_lost_counts_an_optimizer_step_the_estimate_splits_out() -> None:
    @dataclass(frozen=True)
    class WithOptimizer(Step):
        optimizer_s: float = 0.0

    best = Ranked(fitted(layout(2), 1), WithOptimizer(1.0, compute_s=0.9, optimizer_s=0.1))
    runner = Ranked(fitted(layout(4), 1), WithOptimizer(1.1, compute_s=0.9, optimizer_s=0.2))
    assert "optimizer step (+100.00 ms)" in why_lost(runner, best)


def test_why_the_runner_up_lost_names_the_part_it_loses_most_in() -> None:
    best = Ranked(fitted(layout(2), 1), Step(1.0, compute_s=0.8, bubble_s=0.2))
    runner = Ranked(fitted(layout(4), 1), Step(1.25, compute_s=0.8, bubble_s=0.4, exposed_comm_s=0.05))
    line = why_lost(runner, best)
    assert "25.0% slower" in line
    assert "pipeline bubble (+200.00 ms)" in line


# -- the memory function on a real model ------------------------------------------------


def linears(n: int = 4, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)])


def shapes_of(model: nn.Sequential, calls: List[Tuple[int, int]]) -> Shapes:
    def profile_of(tp: int, microbatch: int, sequence: bool = False) -> object:
        calls.append((tp, microbatch))
        x = torch.randn(microbatch, 16)
        return profile(model, x, loss_fn=lambda out, t: out.pow(2).mean(), target=None)

    return Shapes(layers=lambda tp: (model, ()), profile=profile_of)  # type: ignore[arg-type]


def test_state_bytes_is_the_largest_ranks_share_of_parameters_gradients_and_adamw_state() -> None:
    memory = Memory(shapes_of(linears(), []), device_bytes=2**30, global_batch=8)
    # each Linear(16, 16): 272 float32 parameters = 1088 bytes; AdamW: two moments + 4 bytes a tensor
    per_layer = 1088 + 1088 + (2 * 1088 + 2 * 4)
    assert memory.state_bytes(layout(2)) == 2 * per_layer
    assert memory.state_bytes(layout(1)) == 4 * per_layer
    # FSDP over 2: each of weight (16 rows) and bias (16) in halves
    sharded = Candidate(2, 1, 1, 2, "gpipe", 1, 1)
    half = 544
    assert memory.state_bytes(sharded) == 2 * (half + half + 2 * half + 2 * 4)


def test_one_profile_per_micro_batch_size_whatever_the_replicas_and_schedule() -> None:
    calls: List[Tuple[int, int]] = []
    memory = Memory(shapes_of(linears(), calls), device_bytes=2**30, global_batch=8)
    for c in (
        layout(2, dp=1, chunks=2),
        layout(2, dp=1, chunks=2, schedule="1f1b"),
        layout(2, dp=2, chunks=1),
    ):
        memory.fit(c)  # micro-batch 4 each time
    memory.fit(layout(2, dp=1, chunks=4))  # micro-batch 2
    assert calls == [(1, 4), (1, 2)]


def test_fit_chooses_modes_under_the_device_and_reports_each_ranks_peak() -> None:
    memory = Memory(shapes_of(linears(), []), device_bytes=2**30, global_batch=8)
    found = memory.fit(layout(2, chunks=2, schedule="1f1b"))
    assert found.candidate.modes == ("never", "never")  # with room to spare, nothing is recomputed
    assert found.peaks == tuple(s.peak for s in found.prediction.stages)
    assert found.balance == balance_of(linears(), 2) == (2, 2)


def test_a_tight_device_gets_recomputing_modes() -> None:
    roomy = Memory(shapes_of(linears(width=16), []), device_bytes=2**30, global_batch=64)
    free = roomy.fit(layout(2, chunks=2, schedule="1f1b"))
    never_peak = free.peak
    tight = Memory(shapes_of(linears(width=16), []), device_bytes=never_peak - 1, global_batch=64)
    found = tight.fit(layout(2, chunks=2, schedule="1f1b"))
    assert found.candidate.modes != ("never", "never")
    assert found.peak <= never_peak - 1


def test_looped_schedules_are_predicted_as_1f1b_stages_except_looped_bfs() -> None:
    names: Dict[str, str] = {
        s: memory_schedule(s) for s in ("gpipe", "1f1b", "looped_bfs", "interleaved_1f1b", "dual_pipe_v")
    }
    assert names == {
        "gpipe": "gpipe",
        "1f1b": "1f1b",
        "looped_bfs": "gpipe",
        "interleaved_1f1b": "1f1b",
        "dual_pipe_v": "1f1b",
    }


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "interleaved_zero_bubble"])
def test_a_looped_ranks_peak_walks_its_stages_together_along_its_own_order(schedule: str) -> None:
    memory = Memory(shapes_of(linears(), []), device_bytes=2**30, global_batch=8)
    found = memory.fit(Candidate(2, 1, 1, 1, schedule, 2, 2))
    plan = StagePlan(found.balance, (torch.device("cpu"),) * 4, (NEVER,) * 4)
    walked = tuple(
        predict_device(memory.profile(1, 4), plan, chunks=2, order=order, optimizer="adamw").peak
        for order in rank_orders(schedule, 2, 2, 2)
    )
    assert found.peaks == walked
    stages = found.prediction.stages  # below the sum: a rank's stages do not all peak at once
    assert found.peaks[0] < stages[0].peak + stages[2].peak


def test_a_looped_ranks_walk_with_its_unsharded_states_is_its_walk() -> None:
    memory = Memory(shapes_of(linears(), []), device_bytes=2**30, global_batch=8)
    c = Candidate(2, 1, 1, 1, "interleaved_1f1b", 2, 2)
    found = memory.fit(c)
    plan = StagePlan(found.balance, (torch.device("cpu"),) * 4, (NEVER,) * 4)
    states = stage_rank_states(linears(), memory.layout(c), "adamw")(found.balance)
    for order in rank_orders(c.schedule, 2, 2, 2):
        options = dict(chunks=2, order=order, optimizer="adamw")
        bare = predict_device(memory.profile(1, 4), plan, **options)
        walked = predict_device(memory.profile(1, 4), plan, **options, states=states)
        assert (walked.peak, walked.peak_at) == (bare.peak, bare.peak_at)


def test_a_sharded_looped_rank_walks_its_stages_holding_its_shares_of_their_state() -> None:
    """Under FSDP each of a rank's stages holds its parameter and optimizer shards instead of the
    whole, and its gathered parameters and collective buffers beside them all step; the activations
    are the unsharded walk's, so the rank's peak moves by exactly that difference."""
    memory = Memory(shapes_of(linears(), []), device_bytes=2**30, global_batch=8)
    c = Candidate(2, 1, 1, 2, "interleaved_1f1b", 2, 2)  # micro-batches of 8 / 2 / 2 = 2 samples
    sharded = memory.fit(c)
    plan = StagePlan(sharded.balance, (torch.device("cpu"),) * 4, (NEVER,) * 4)
    states = stage_rank_states(linears(), memory.layout(c), "adamw")(sharded.balance)
    for rank, order in enumerate(rank_orders(c.schedule, 2, 2, 2)):
        whole = predict_device(memory.profile(1, 2), plan, chunks=2, order=order, optimizer="adamw")
        held = [states[j] for j in (rank, rank + 2)]  # interleaved: stages r and r + pp
        saved = sum(
            w.params + w.optimizer + w.grads
            - s.params - s.optimizer - s.grads_backward - max(s.unsharded, s.unsharded_backward or 0)
            - s.collectives
            for s, w in held
        )  # fmt: skip
        assert saved > 0
        assert sharded.peaks[rank] == whole.peak - saved
    stages = sharded.prediction.stages  # below the sum of the stages' own peaks
    assert sharded.peaks[0] < stages[0].peak + stages[2].peak


def test_reducing_every_micro_batch_is_dropped_where_its_twin_fits_without_recompute() -> None:
    once = Candidate(1, 1, 1, 2, "gpipe", 1, 2, modes=())
    every = replace(once, reduce_every=True)
    asked: List[Candidate] = []

    def memory(c: Candidate) -> Fitted:
        asked.append(c)
        return fitted(replace(c, modes=("never",)), 10)

    found = search(
        [once, every], device_bytes=100, state=lambda c: 0, memory=memory, cost=lambda c: Step(1.0)
    )
    assert asked == [once]  # no memory fit for the dominated twin
    assert [(d.candidate, d.stage) for d in found.dropped] == [(every, "dominated")]


def test_reducing_every_micro_batch_is_searched_where_its_twin_recomputes() -> None:
    once = Candidate(1, 1, 1, 2, "gpipe", 1, 2, modes=())
    every = replace(once, reduce_every=True)
    modes = {once: ("always",), every: ("never",)}
    found = search(
        [once, every],
        device_bytes=100,
        state=lambda c: 0,
        memory=lambda c: fitted(replace(c, modes=modes[c]), 10),
        cost=lambda c: Step(2.0 if c.modes == ("always",) else 1.0),
    )
    assert [r.candidate.reduce_every for r in found.ranked] == [True, False]  # memory bought time


def test_progress_is_told_before_each_layout_with_the_fits_so_far() -> None:
    told: List[Tuple[int, int, int]] = []
    search(
        [layout(pp) for pp in (1, 2, 4)],
        device_bytes=100,
        state=lambda c: 0,
        memory=lambda c: fitted(c, 10 if c.pp < 4 else 200),
        cost=lambda c: Step(1.0),
        progress=lambda *a: told.append(a),
    )
    assert told == [(0, 3, 0), (1, 3, 1), (2, 3, 2)]


def test_the_progress_line_is_written_at_most_once_a_period() -> None:
    now = [0.0]
    out = io.StringIO()
    progress = progress_printer(60.0, out, clock=lambda: now[0])
    for t, done in ((30.0, 10), (61.0, 20), (90.0, 30), (125.0, 40)):
        now[0] = t
        progress(done, 100, done // 10)
    assert out.getvalue().splitlines() == [
        "layout search: 20 of 100 layouts done, 2 fit so far, 61 s",
        "layout search: 40 of 100 layouts done, 4 fit so far, 125 s",
    ]
