"""A stage whose engine runs each micro-batch's backward as its own autograd call (the distributed
engine's schedules) runs a kept micro-batch as plain autograd, without the recompute Function, and
its gradients stay bitwise equal to every mode's."""

from typing import List, Tuple

import pytest
import torch
from support.toy import toy_layers
from torch import Tensor

from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.stages.stage import Stage

M = 4
# A 1F1B-like order of the micro-batches' backwards: not the order of their forwards.
BACKWARD_ORDER = [0, 2, 1, 3]


def stage_of(mode: str, *, per_microbatch: bool) -> Stage:
    torch.manual_seed(0)
    layers = toy_layers(depth=4, dropout=0.3)
    stage = Stage(layers, index=1, mode=parse_modes(mode, 1)[0], device=torch.device("cpu"))
    stage.backward_per_microbatch = per_microbatch
    return stage


def step(stage: Stage) -> Tuple[List[Tensor], List[Tensor], List[Tensor]]:
    """One step of ``M`` micro-batches, each backward its own autograd call: the outputs, the
    parameters' gradients and the inputs' gradients."""
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 8, generator=g).requires_grad_() for _ in range(M)]
    grads = [torch.randn(2, 3, generator=g) for _ in range(M)]
    torch.manual_seed(2)  # the dropout masks
    stage.begin_step(M)
    outputs = [stage(x) for x in inputs]
    for i in BACKWARD_ORDER:
        torch.autograd.backward(outputs[i], grads[i])
    params = [p.grad.clone() for p in stage.partition.parameters()]
    return outputs, params, [x.grad for x in inputs]


def _through_recompute(output: Tensor) -> bool:
    return output.grad_fn is not None and "_Recompute" in type(output.grad_fn).__name__


def test_a_kept_microbatch_skips_the_recompute_function_when_each_backward_is_its_own_call() -> None:
    outputs, _, _ = step(stage_of("never", per_microbatch=True))
    assert not any(_through_recompute(o) for o in outputs)


def test_without_it_every_microbatch_goes_through_the_recompute_function() -> None:
    outputs, _, _ = step(stage_of("never", per_microbatch=False))
    assert all(_through_recompute(o) for o in outputs)


def test_a_recomputed_microbatch_still_goes_through_the_recompute_function() -> None:
    outputs, _, _ = step(stage_of("always", per_microbatch=True))
    assert all(_through_recompute(o) for o in outputs)


def test_a_split_backward_keeps_the_function_for_its_weight_pass() -> None:
    stage = stage_of("never", per_microbatch=True)
    stage.weight_passes = []
    stage.begin_step(M)
    assert _through_recompute(stage(torch.randn(2, 8, requires_grad=True)))


@pytest.mark.parametrize("mode", ["except_last", "always", "offload", "never"])
def test_gradients_are_bitwise_equal_to_the_functions_in_every_mode(mode: str) -> None:
    _, expected_params, expected_inputs = step(stage_of("never", per_microbatch=False))
    _, params, inputs = step(stage_of(mode, per_microbatch=True))
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(inputs, expected_inputs, strict=True))


def test_a_stage_sharing_parameters_with_another_keeps_the_function() -> None:
    stage = stage_of("never", per_microbatch=True)
    stage.shares_parameters = True
    outputs, _, _ = step(stage)
    assert all(_through_recompute(o) for o in outputs)
