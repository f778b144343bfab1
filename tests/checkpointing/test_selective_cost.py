"""The planner's time model charges eager selective checkpointing its host cost: SAC's dispatch mode
runs Python for every op, in the forward and again in the recompute, which on a layer of many small
ops costs more than the recompute it saves. Where the profile measured it (``sac_extra_s``) the
model takes that; where it did not (a ``pipeline_of`` model's pytrees, fake tensors) it charges
each op the layer runs SAC's per-op host cost, measured once per process. Under ``compile`` the
policy runs at compile time (test_compile_selective.py): no host cost. The tests compare the
planner's inputs and decisions, never a wall clock."""

import dataclasses
from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeckpt.checkpointing.modes import parse_mode
from pipeckpt.memory import timing
from pipeckpt.memory.auto import choose
from pipeckpt.memory.profile import ModelProfile, profile
from pipeckpt.memory.stage_model import _StageModel


class ManySmallOps(nn.Module):
    """One small matmul (what SAC keeps) and many small elementwise ops (what it recomputes): a
    dispatch-bound layer, where SAC's per-op host cost is all its time."""

    def __init__(self, width: int = 4, ops: int = 60) -> None:
        super().__init__()
        self.linear, self.ops = nn.Linear(width, width), ops

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        for _ in range(self.ops):
            h = torch.tanh(h) * 0.5
        return h


def unmeasured(p: ModelProfile) -> ModelProfile:
    """``p`` with no measured SAC cost per layer, as a ``pipeline_of`` model's or a fake profile is."""
    return dataclasses.replace(p, layers=tuple(dataclasses.replace(x, sac_extra_s=None) for x in p.layers))


def small_ops_profile() -> ModelProfile:
    torch.manual_seed(0)
    layers = nn.Sequential(*[ManySmallOps() for _ in range(4)])
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    return unmeasured(profile(layers, x, loss_fn=F.mse_loss, target=y, rounds=2))


def test_the_profile_counts_the_aten_ops_each_layer_runs() -> None:
    layers = nn.Sequential(ManySmallOps(ops=60), ManySmallOps(ops=120))
    p = profile(layers, torch.randn(4, 4), loss_fn=F.mse_loss, target=torch.randn(4, 4), rounds=1)
    assert p.layers[1].ops - p.layers[0].ops == 2 * 60  # a tanh and a mul per step of the loop


def test_an_unmeasured_selective_layer_is_charged_sacs_host_cost_per_op() -> None:
    p = small_ops_profile()
    per_op = timing.sac_host_s_per_op()
    assert per_op > 0 and timing.sac_host_s_per_op() == per_op  # measured once per process
    model = _StageModel(p, 0, 4, first=True, last=False, local=True)
    expected = sum(max(0.0, x.forward_s - x.sac_s) + x.ops * per_op for x in p.layers)
    assert model.recompute_s(parse_mode("selective")) == expected


def test_under_compile_selective_is_charged_only_the_ops_it_recomputes() -> None:
    p = timing.for_compile(small_ops_profile(), True)
    model = _StageModel(p, 0, 4, first=True, last=False, local=True)
    assert model.recompute_s(parse_mode("selective")) == sum(
        max(0.0, x.forward_s - x.sac_s) for x in p.layers
    )
    assert timing.for_compile(p, True) == p  # the same profile given again (AutoPlan.profiles)


def picked(p: ModelProfile) -> List[str]:
    choice = choose(p, 2**30, balance=[2, 2], chunks=2, modes=["always", "selective"], shared_device=True)
    return [m.name for m in choice.modes]


def test_auto_picks_always_over_eager_selective_where_the_host_cost_dominates() -> None:
    assert picked(small_ops_profile()) == ["always", "always"]


def test_auto_may_pick_selective_under_compile_where_no_host_cost_is_paid() -> None:
    assert picked(timing.for_compile(small_ops_profile(), True)) == ["selective", "selective"]
