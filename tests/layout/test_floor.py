"""The step floor: at or below the cost model's step under every checkpoint mode, and tight where
nothing is recomputed. The search stops on it (tests/layout/test_search.py, "floor")."""

from dataclasses import replace
from typing import List

import pytest

from pipeckpt.layout.candidates import Candidate, Model, candidates
from pipeckpt.layout.cluster import cluster
from pipeckpt.layout.cost import estimate
from pipeckpt.layout.floor import step_floor
from pipeckpt.layout.model_costs import model_costs_from_config

# A GPT-2-shaped model on two A100 nodes: every schedule, sharding and TP degree the search offers.
GPT = model_costs_from_config(dict(n_embd=1024, n_head=16, n_layer=8, vocab_size=51200), seq_len=1024)
CLUSTER = cluster("a100_8x8", devices=16)
BATCH, SEQ, PRECISION = 64, 1024, "bf16-mixed"
MODES = ("never", "except_last", "always", "offload", "selective")


def layouts() -> List[Candidate]:
    model = Model(layers=8, heads=16, tensor_parallel=True)
    return candidates(16, model, global_batch=BATCH, devices_per_node=8)


def step_of(c: Candidate) -> float:
    return estimate(
        c, GPT, CLUSTER, global_batch=BATCH, seq_len=SEQ, precision=PRECISION,
        reshard_after_forward=c.reshard, reduce_every_microbatch=c.reduce_every,
    ).step_s  # fmt: skip


def floor_of(c: Candidate) -> float:
    return step_floor(
        c, GPT, CLUSTER, global_batch=BATCH, seq_len=SEQ, precision=PRECISION,
        reshard_after_forward=c.reshard, reduce_every_microbatch=c.reduce_every,
    )  # fmt: skip


def test_the_search_offers_every_schedule_sharding_and_tp_degree_here() -> None:
    found = layouts()
    assert {c.schedule for c in found} == {
        "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble",
        "dual_pipe_v",
    }  # fmt: skip
    assert {c.tp for c in found} == {1, 2, 4, 8} and any(c.reshard for c in found)
    assert any(c.reduce_every for c in found) and any(c.dp_replicate > 1 for c in found)


@pytest.mark.parametrize("mode", MODES)
def test_no_mode_gives_a_step_below_the_floor(mode: str) -> None:
    for c in layouts():
        floor = floor_of(c)
        moded = replace(c, modes=(mode,) * c.stages)
        assert floor <= step_of(moded) * (1 + 1e-12), (c, mode)


def test_mixed_modes_per_stage_stay_above_the_floor() -> None:
    for c in layouts():
        if c.stages > 1:
            mixed = tuple(MODES[j % len(MODES)] for j in range(c.stages))
            assert floor_of(c) <= step_of(replace(c, modes=mixed)) * (1 + 1e-12), c


def test_the_floor_is_the_step_of_one_stage_with_nothing_recomputed() -> None:
    """One stage, one micro-batch: no bubble and no sends, so the floor is the estimate itself."""
    for c in layouts():
        if c.pp == 1 and c.chunks == 1:
            assert floor_of(c) == pytest.approx(step_of(c), rel=1e-12), c


def test_the_floor_counts_the_fill_and_drain_of_1f1b() -> None:
    """1F1B over 8 stages, each its own rank: (m + p - 1) micro-batch slots on the critical path, of
    which the floor sees at least the first micro-batch's forwards in and the last's backwards out."""
    c = Candidate(8, 1, 2, 1, "1f1b", 1, 8)
    assert floor_of(c) >= 0.95 * step_of(c)
