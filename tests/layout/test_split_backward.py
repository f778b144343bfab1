"""A zero-bubble schedule's split backward as the cost model prices it: which pass makes which
gradients (the engine's rules: a stage that does not split makes them all in its input pass, the
first stage's input takes no gradient), the split counted from FLOPs, and the split timed on a real
model."""

import pytest
import torch
from torch import nn

from pipeckpt.layout.split_backward import HALVES, WHOLE, SplitBackward, from_flops, measured
from tests.layout.test_cost import BATCH, SEQ, Layout, forward_s, run, toy, toy_cluster


def test_a_split_stage_divides_its_backward_times_the_splits_cost_by_the_input_share() -> None:
    split = SplitBackward(input_share=0.75, factor=1.2)
    assert split.at(10.0, first=False) == pytest.approx((9.0, 3.0))
    assert HALVES.at(10.0, first=False) == (5.0, 5.0)


def test_the_first_stage_makes_every_gradient_in_its_weight_pass() -> None:
    # its input (token ids) takes no gradient: the engine's input pass has nothing to make
    assert SplitBackward(input_share=0.75, factor=1.2).at(10.0, first=True) == (0.0, 10.0)


def test_a_stage_that_does_not_split_makes_every_gradient_in_its_input_pass() -> None:
    assert WHOLE.at(10.0, first=False) == (10.0, 0.0)
    assert WHOLE.at(10.0, first=True) == (10.0, 0.0)


def test_attentions_gradients_are_the_input_passes_in_a_flop_count() -> None:
    assert from_flops(100.0, 0.0).input_share == 0.5
    assert from_flops(100.0, 50.0).input_share == pytest.approx((100 + 100) / (200 + 100))
    assert from_flops(100.0, 50.0).factor == 1.0


def test_a_zero_bubble_ranks_compute_is_its_passes_as_the_split_prices_them() -> None:
    # pp 2, V-shaped: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2, one layer each
    m = 4
    f = forward_s(1, BATCH // m * SEQ)
    split = SplitBackward(input_share=0.75, factor=1.2)
    layout = Layout(pp=2, schedule="zbv_zero_bubble", virtual_stages=2, chunks=m)
    e = run(layout, 2, model=toy(split_backward=split), cluster=toy_cluster(2))
    first = f + 0.0 + 2 * f  # forward, no input pass, the whole backward in the weight pass
    other = f + 2 * f * 1.2  # forward, input and weight passes
    # the step ends on rank 0, whose last ops are the first stage's weight passes
    assert e.compute_s == pytest.approx(m * (first + other))
    halves = run(layout, 2, cluster=toy_cluster(2))
    assert halves.compute_s == pytest.approx(m * 2 * 3 * f)


def test_a_selective_stage_runs_its_whole_backward_in_its_input_pass() -> None:
    # the engine does not split a selective stage (torch's checkpoint recomputes once): the split's
    # 1.2x is not paid, and nothing is left for the weight pass to fill a bubble with
    m = 4
    f = forward_s(1, BATCH // m * SEQ)
    split = SplitBackward(input_share=0.75, factor=1.2)
    layout = Layout(pp=2, schedule="zbv_zero_bubble", virtual_stages=2, chunks=m, modes=("selective",) * 4)
    e = run(layout, 2, model=toy(split_backward=split), cluster=toy_cluster(2))
    assert e.compute_s == pytest.approx(m * 2 * (f + 2 * f))


def test_a_timed_split_leaves_the_gradients_as_it_found_them() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Embedding(16, 32), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))
    found = {p: torch.randn_like(p) for p in layers.parameters()}
    for p, g in found.items():
        p.grad = g
    target = torch.randint(0, 16, (8, 4))
    split = measured(list(layers), torch.randint(0, 16, (8, 4)), _loss, target, rounds=2)
    assert split is not None and split.splits
    assert 0.0 < split.input_share < 1.0 and split.factor > 0.0
    assert all(p.grad is g for p, g in found.items())


def test_a_first_layer_whose_output_takes_no_gradient_is_not_timed() -> None:
    layers = [nn.Identity(), nn.Linear(4, 4)]
    assert measured(layers, torch.zeros(2, 4, dtype=torch.long)) is None


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
