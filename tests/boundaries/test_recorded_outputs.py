"""Outputs a model records inside its layers cross the stages with their gradients (local engine):
Mixtral and Qwen3-MoE (tiny random configs) with the routers' load-balancing loss on, trained with
``self.model(**batch).loss``, 2 stages, chunks 2, under every checkpoint mode, equal within 1e-5 to the
unpipelined model that computes the same per-micro-batch losses (each micro-batch's load-balancing
loss is its own: it is not linear in the batch, like BatchNorm), router gradients included. Without
carrying them, never and except_last failed in backward and always dropped the aux loss's gradient.
Hidden states (recorded on the layers' own outputs) carry their gradients too: a loss on a middle
layer's trains as unpipelined."""

from typing import Dict

import pytest
import torch
from support.trainers import quiet_trainer
from torch import Tensor
from torch.utils.data import DataLoader

import pipeckpt
from pipeckpt.sizes import parse_bytes

pytest.importorskip("transformers")
from support.hf_models import HFModule, batches, whole
from support.moe_models import MOE, MoEModule, is_router, per_microbatch_loss

STEPS = 3
MODES = ["never", "except_last", "always", "selective"]


def trained(module: MoEModule, strategy: object = None) -> MoEModule:
    quiet_trainer(strategy, max_steps=STEPS).fit(module, DataLoader(batches(STEPS), batch_size=None))
    return module


def state(module: MoEModule) -> Dict[str, Tensor]:
    return {k: v.detach() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def references() -> Dict[str, MoEModule]:
    return {name: trained(MoEModule(name, chunks=2)) for name in MOE}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_with_router_loss_trains_as_the_per_microbatch_reference(references, name, mode):
    want = references[name]
    got = trained(MoEModule(name), pipeckpt.PipelineStrategy(stages=2, chunks=2, checkpoint=mode))
    a, b = state(got), state(want)
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)
    assert got.losses == pytest.approx(want.losses, rel=1e-5, abs=1e-6)
    assert len(want.router_grads) == 4 and got.router_grads.keys() == want.router_grads.keys()
    for k, g in want.router_grads.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(got.router_grads[k], g, rtol=1e-5, atol=1e-7, msg=k)


#: Never everywhere is predicted at about 1.5 MiB for both tiny MoE models' stages on the one CPU; this
#: budget makes auto recompute at least one of them.
MOE_BUDGET = "1.2MiB"


@pytest.mark.parametrize("name", sorted(MOE))
def test_auto_plans_and_trains_moe_with_router_loss_as_the_per_microbatch_reference(references, name):
    """The profile runs the model's own code with its layers answering what they returned: the router
    logits recorded inside them are replayed there, so HF's load-balancing loss has them (it raised
    IndexError on an empty tuple)."""
    want = references[name]
    strategy = pipeckpt.PipelineStrategy(stages=2, chunks=2, checkpoint="auto", memory_budget=MOE_BUDGET)
    got = trained(MoEModule(name), strategy)
    assert any(m.checkpoints for m in strategy.plan.modes)
    assert strategy.auto_plan.choice.process_peak <= parse_bytes(MOE_BUDGET)
    a, b = state(got), state(want)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)
    assert got.losses == pytest.approx(want.losses, rel=1e-5, abs=1e-6)
    assert got.router_grads.keys() == want.router_grads.keys() and len(want.router_grads) == 4
    for k, g in want.router_grads.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(got.router_grads[k], g, rtol=1e-5, atol=1e-7, msg=k)


def test_the_aux_loss_moves_the_routers():
    """The reference is not blind to the aux term: without it the routers' gradients differ."""
    torch.manual_seed(0)
    model = MOE["mixtral"]()
    batch = batches(1)[0]
    grads = []
    for coef in (0.1, 0.0):
        model.router_aux_loss_coef = coef  # read at each forward (config: at init)
        model.zero_grad()
        per_microbatch_loss(model, batch, 2).backward()
        grads.append(torch.cat([p.grad.flatten() for k, p in model.named_parameters() if is_router(k)]))
    assert (grads[0] - grads[1]).abs().max() > 1e-4


class HiddenStateLoss(HFModule):
    """Llama trained on HF's loss plus a middle layer's hidden state's mean square (recorded by HF's
    hooks on the layers themselves, output_hidden_states=True)."""

    def __init__(self) -> None:
        super().__init__("llama", whole)

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(**batch, output_hidden_states=True)
        return out.loss + 0.1 * out.hidden_states[2].pow(2).mean()


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_loss_on_a_middle_layers_hidden_state_trains_as_unpipelined(mode):
    loader = DataLoader(batches(2), batch_size=None)
    want, got = HiddenStateLoss(), HiddenStateLoss()
    quiet_trainer(max_steps=2).fit(want, loader)
    quiet_trainer(pipeckpt.PipelineStrategy(stages=2, chunks=2, checkpoint=mode), max_steps=2).fit(
        got, loader
    )
    a, b = state(got), state(want)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)
