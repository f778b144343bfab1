"""Nothing leaves a stage silently: a tensor a layer hands out other than through its return value (a
list the loss reads, a forward hook that stores an activation, Hugging Face's recorders) carries the
stage's graph around its checkpoint; under every mode it is refused at the first step, with the layer
named in the user's own names, before any parameter changes. So is a hook that keeps the very tensor a
stage returns (it crashed in backward under the recomputing modes, or was lost to the distributed
engine's loss). A copy without graph (``detach()``) is no escape and trains, and so does a hook on a
pipelined layer itself (it runs on what the stage returned); after the first step nothing is checked
(stages/escapes.py)."""

from typing import Any, Dict

import pytest
import torch
from support.side_channels import HookedBlocks, ReStoring, SideChannel, loader
from support.trainers import quiet_trainer
from torch import Tensor

import pipeckpt
from pipeckpt import PipeckptConfigError
from pipeckpt.stages import escapes

MODES = ["never", "except_last", "always", "offload", "selective", "selective:1"]


def params(module: Any) -> Dict[str, Tensor]:
    return {k: p.detach().clone() for k, p in module.named_parameters()}


def fit(module: Any, mode: str, steps: int = 1) -> None:
    strategy = pipeckpt.PipelineStrategy(stages=2, chunks=2, checkpoint=mode)
    quiet_trainer(strategy, max_steps=steps).fit(module, loader())


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_that_stashes_its_activation_for_the_loss_is_refused_at_the_first_step(mode):
    module = SideChannel(at=0)
    before = params(module)
    with pytest.raises(PipeckptConfigError) as error:
        fit(module, mode)
    message = str(error.value)
    assert (
        "layer 'layers.0' (pipeline stage 0) hands out a tensor other than through its return value"
        in message
    )
    assert "still held by a list" in message and "HINT: return the tensor from the layer" in message
    after = params(module)
    assert all(torch.equal(after[k], before[k]) for k in before)  # refused before any step


@pytest.mark.parametrize("mode", ["never", "always", "selective"])
def test_a_forward_hook_storing_a_pipelined_layers_activation_is_refused(mode):
    with pytest.raises(PipeckptConfigError, match=r"layer 'model\.blocks\.1' \(pipeline stage 0\) hands out"):
        fit(HookedBlocks(), mode)


RESTORED = "layer 'model.blocks.1' (pipeline stage 0) keeps aside the very tensor its pipeline stage returns"


@pytest.mark.parametrize("mode", MODES)
def test_a_hook_keeping_the_tensor_a_stage_returns_is_refused_at_the_first_step(mode):
    """The hook is on block 1's last module (its Tanh): the tensor it keeps is the block's output,
    which the first stage returns."""
    module = ReStoring(at=1)
    before = params(module)
    with pytest.raises(PipeckptConfigError) as error:
        fit(module, mode)
    message = str(error.value)
    assert RESTORED in message and "is also held by a list" in message
    assert "HINT: read the value from what the model returns" in message
    after = params(module)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
def test_a_sequential_layer_keeping_the_output_it_returns_at_a_stage_end_is_refused(mode):
    """Layer 1 of 4 (the first stage's last, 2 stages) appends its own return value to a list."""
    with pytest.raises(
        PipeckptConfigError, match=r"layer 'layers\.1' \(pipeline stage 0\) keeps aside the very"
    ):
        fit(SideChannel(at=1), mode)


@pytest.mark.parametrize("mode", ["never", "always", "selective"])
def test_a_hook_on_the_pipelined_layer_itself_trains_as_unpipelined(mode):
    """The hook on block 1 itself runs outside the stage, on what the stage returned (the tensor that
    crossed its checkpoint): kept for the loss, its gradient goes through the stage once."""
    want = ReStoring(at=1, inside=False)
    quiet_trainer(max_steps=2).fit(want, loader())
    got = ReStoring(at=1, inside=False)
    fit(got, mode, steps=2)
    a, b = params(got), params(want)
    assert all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in b)
    assert any(not torch.equal(a[k], params(ReStoring())[k]) for k in a)  # it trained


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_copy_without_graph_is_no_escape_and_trains_as_unpipelined(mode):
    want = SideChannel(at=0, detached=True)
    quiet_trainer(max_steps=2).fit(want, loader())
    got = SideChannel(at=0, detached=True)
    fit(got, mode, steps=2)
    a, b = params(got), params(want)
    assert all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in b)


def test_only_the_first_step_is_checked(monkeypatch):
    made = []
    real = escapes.EscapeWatch.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(args[0])
        real(self, *args, **kwargs)

    monkeypatch.setattr(escapes.EscapeWatch, "__init__", counted)
    fit(SideChannel(at=0, detached=True), "except_last", steps=3)
    assert sorted(made) == [0, 1]  # one check per stage, at the first step's first micro-batch


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_compiled_layer_that_stashes_its_activation_is_refused_as_the_eager_one_is(mode):
    # the checked micro-batch runs the layer's own forward, not the compiler's first call
    strategy = pipeckpt.PipelineStrategy(stages=2, chunks=2, checkpoint=mode, compile="aot_eager")
    with pytest.raises(PipeckptConfigError, match=r"layer 'layers\.0' \(pipeline stage 0\) hands out .*list"):
        quiet_trainer(strategy, max_steps=1).fit(SideChannel(at=0), loader())
