"""The step of processes that share fewer cores than there are of them: each hand case's timeline is
written out in its docstring, one op a second unless it says otherwise."""

import itertools

import pytest

from pipeckpt.layout.orders import RankOp, rank_orders, simulate
from pipeckpt.layout.shared_cores import simulate_shared


def forward_only(op: RankOp) -> float:
    return 1.0 if op[1] == "F" else 0.0


def test_three_ranks_busy_on_two_cores_run_at_two_thirds() -> None:
    """GPipe, 3 stages, 3 micro-batches, forwards 1 s, backwards free, 2 cores:
    0-1 rank 0 alone; 1-2 ranks 0, 1 (a core each); 2-3.5 ranks 0, 1, 2 at 2/3 speed;
    3.5-4.5 ranks 1, 2; 4.5-5.5 rank 2; then every backward at once: 5.5 s, where a core each gives
    5 and the work over the cores 4.5."""
    orders = rank_orders("gpipe", 3, 1, 3)
    shared = simulate_shared(orders, forward_only, stages=3, cores=2)
    assert shared == pytest.approx([5.5, 5.5, 5.5])
    assert max(simulate(orders, forward_only, stages=3)) == pytest.approx(5.0)


def test_replicas_count_as_processes_of_their_pipeline_rank() -> None:
    """One stage, one micro-batch (forward 1 s, backward 2 s), 4 replicas on 2 cores: half speed,
    6 s, then a tail of 1 s at half speed: 8 s."""
    orders = rank_orders("gpipe", 1, 1, 1)
    times = lambda op: 1.0 if op[1] == "F" else 2.0  # noqa: E731
    assert simulate_shared(orders, times, stages=1, cores=2, replicas=4) == pytest.approx([6.0])
    assert simulate_shared(orders, times, stages=1, cores=2, replicas=4, tail_s=[1.0]) == pytest.approx([8.0])


def test_sends_and_starts_are_waits_that_take_no_core() -> None:
    """GPipe, 2 stages, 1 micro-batch, 1 core: rank 0 starts at 0.5 (its gather), forward 0.5-1.5,
    the send 1.5-2, rank 1's forward and backward 2-4, the send back 4-4.5, rank 0's backward
    4.5-5.5."""
    orders = rank_orders("gpipe", 2, 1, 1)
    out = simulate_shared(orders, lambda op: 1.0, stages=2, cores=1, send_s=lambda j: 0.5, start_s=[0.5])
    assert out == pytest.approx([5.5, 4.0])


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), [("1f1b", 4, 1, 8), ("interleaved_1f1b", 2, 2, 4)])
def test_with_a_core_each_it_is_the_dedicated_simulation(schedule: str, pp: int, v: int, m: int) -> None:
    """Cores for every process: the same finish times as :func:`simulate` (plus the tails)."""
    orders = rank_orders(schedule, pp, v, m)
    weights = dict(zip(itertools.product(range(pp * v), "FBIW"), itertools.cycle([1.0, 2.5, 0.7, 1.3])))
    times = lambda op: weights[op[0], op[1]]  # noqa: E731
    kwargs = dict(stages=pp * v, send_s=lambda j: 0.25 * (j + 1), start_s=[0.1 * r for r in range(pp)])
    tails = [0.5] * pp
    dedicated = simulate(orders, times, **kwargs)
    shared = simulate_shared(orders, times, cores=pp, tail_s=tails, **kwargs)
    assert shared == pytest.approx([d + t for d, t in zip(dedicated, tails)])
