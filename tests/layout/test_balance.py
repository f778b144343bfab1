"""Stages cut by time (pipeckpt/layout/balance.py): the slowest stage's forward FLOPs as small as any
contiguous cut makes them, the head counted with the last layer; each pipelined layout listed again
so cut where that differs from the engine's cut by parameters."""

import itertools
from typing import Sequence, Tuple

from pipeckpt.layout.balance import by_time, with_time_cuts
from pipeckpt.layout.candidates import Candidate, Model, candidates
from pipeckpt.layout.cost import balance
from pipeckpt.layout.model_costs import ModelCosts

LAYERS = 8


def _costs(head_flops: float, layer_flops: Sequence[float] = (100.0,) * LAYERS) -> ModelCosts:
    n = len(layer_flops)
    return ModelCosts(
        name="test",
        seq_len=16,
        hidden=8,
        heads=2,
        vocab=64,
        layer_flops=tuple(layer_flops),
        layer_attention_flops=(0.0,) * n,
        layer_params=(1000,) * n,
        embedding_params=512,
        head_params=512,
        head_flops=head_flops,
        boundary_bytes_per_token=32.0,
    )


def _largest(costs: ModelCosts, cut: Tuple[int, ...]) -> float:
    work = list(costs.layer_flops)
    work[-1] += costs.head_flops
    starts = list(itertools.accumulate((0, *cut)))
    return max(sum(work[a:b]) for a, b in itertools.pairwise(starts))


def _every_cut(layers: int, stages: int) -> list:
    return [
        tuple(b - a for a, b in zip((0, *cuts), (*cuts, layers)))
        for cuts in itertools.combinations(range(1, layers), stages - 1)
    ]


def test_a_heavy_head_leaves_the_last_stage_fewer_layers():
    costs = _costs(head_flops=250.0)
    assert balance(costs, 2) == (4, 4)  # the engine's cut: every layer weighs alike
    assert by_time(costs, 2) == (5, 3)  # 500 and 300 + 250, where 4 and 4 + 2.5 layers gave 650


def test_the_cut_by_time_has_the_smallest_slowest_stage_of_every_cut():
    costs = _costs(head_flops=170.0, layer_flops=(90, 120, 100, 80, 130, 100, 95, 110))
    for stages in (2, 3, 4):
        best = min(_largest(costs, cut) for cut in _every_cut(LAYERS, stages))
        assert _largest(costs, by_time(costs, stages)) == best, stages


def test_without_a_head_equal_layers_are_cut_as_the_engine_cuts_them():
    costs = _costs(head_flops=0.0)
    assert all(by_time(costs, s) == balance(costs, s) for s in (2, 4, 8))


def test_each_pipeline_of_a_stage_a_rank_is_listed_again_cut_by_time_right_after_it_where_cuts_differ():
    found = candidates(4, Model(layers=LAYERS), global_batch=8)
    listed = with_time_cuts(found, _costs(head_flops=250.0))
    assert [c for c in listed if not c.balance] == found
    for i, c in enumerate(listed):
        if c.balance:
            assert listed[i - 1] == Candidate(**{**c.__dict__, "balance": ()})
            assert c.balance == by_time(_costs(head_flops=250.0), c.stages)
    costs = _costs(head_flops=250.0)
    differ = [
        c
        for c in found
        if c.virtual_stages == 1 and c.stages > 1 and by_time(costs, c.stages) != balance(costs, c.stages)
    ]
    assert differ and len(listed) == len(found) + len(differ)  # 8 stages of 8 layers: one cut only


def test_no_layout_is_listed_again_where_its_cut_by_time_is_the_engines():
    found = candidates(4, Model(layers=LAYERS), global_batch=8)
    assert with_time_cuts(found, _costs(head_flops=0.0)) == found


def test_a_layout_cut_by_time_says_so_and_trains_with_its_cut():
    c = Candidate(2, 1, 1, 1, "1f1b", 1, 4, balance=(5, 3))
    assert c.describe() == "pp2 by time x tp1 x dp1"
    assert c.settings()["balance"] == [5, 3]
    assert Candidate(2, 1, 1, 1, "1f1b", 1, 4).settings()["balance"] is None


def test_a_looped_layout_is_not_cut_by_time():
    found = candidates(4, Model(layers=LAYERS), global_batch=8)
    listed = with_time_cuts(found, _costs(head_flops=250.0))
    assert any(c.virtual_stages > 1 for c in found)
    assert not any(c.balance and c.virtual_stages > 1 for c in listed)
