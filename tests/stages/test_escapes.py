"""Nothing leaves a stage silently: a tensor a layer hands out other than through its return value (a
list the loss reads, a forward hook that stores an activation, Hugging Face's recorders) carries the
stage's graph around its checkpoint; under every mode it is refused at the first step, with the layer
named in the user's own names, before any parameter changes. A copy without graph (``detach()``) is no
escape and trains; after the first step nothing is checked (stages/escapes.py)."""

from typing import Any, Dict

import pytest
import torch
from support.side_channels import HookedBlocks, SideChannel, loader
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
