"""Selective checkpointing (`selective`, `except_last+selective`, with `:k`): torch's SAC keeps the
matmul outputs and recomputes the rest; gradients and BatchNorm statistics stay bitwise equal to
`never` with dropout on; the compositions that make no sense are refused by name."""

from typing import Any, Dict

import pytest
import torch
from test_boundary import run_masked, run_tree
from test_granularity import assert_bitwise, train_once
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from pipeckpt import PipeckptConfigError, pipeline_of
from pipeckpt._compat import TorchDispatchMode
from pipeckpt.checkpointing.modes import parse_mode
from pipeckpt.checkpointing.selective import policy
from pipeckpt.engines.local.module import ModuleRunner
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

CPU = [torch.device("cpu")]
SELECTIVE = [
    "selective",
    "selective:1",
    "except_last+selective",
    "except_last+selective:2",
    ["selective:2", "always"],
]


def test_selective_is_always_with_sac_and_composes_with_except_last_and_segments():
    s, e = parse_mode("selective"), parse_mode("except_last+selective:2")
    assert (s.selective, s.recompute_last, s.every) == (True, True, None)
    assert (e.selective, e.recompute_last, e.every, e.name) == (True, False, 2, "except_last+selective:2")


@pytest.mark.parametrize(
    "spec, rule",
    [
        ("offload+selective", r"'offload\+selective'.*offload keeps the stage's inputs on the host.*HINT"),
        ("never+selective", r"'never\+selective'.*never recomputes nothing.*HINT"),
        ("always+sac", r"'always\+sac'.*is not one of.*HINT"),
    ],
)
def test_a_composition_that_makes_no_sense_is_refused_by_name(spec, rule):
    with pytest.raises(PipeckptConfigError, match=rule):
        parse_mode(spec)


@pytest.mark.parametrize(
    "op, kept",
    [
        (torch.ops.aten.mm.default, True),
        (torch.ops.aten.addmm.default, True),
        (torch.ops.aten.bmm.default, True),
        (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, True),
        (torch.ops.aten.tanh.default, False),
        (torch.ops.aten.native_dropout.default, False),
    ],
)
def test_the_policy_keeps_matmul_and_attention_outputs_and_recomputes_the_rest(op, kept):
    expected = CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, op) == expected


@pytest.mark.parametrize("mode", SELECTIVE, ids=str)
def test_selective_gradients_bitwise_equal_never_with_dropout(mode):
    assert_bitwise(train_once(mode), train_once("never"))


@pytest.mark.parametrize("mode", ["selective", "except_last+selective:1"])
def test_selective_gradients_and_batch_norm_statistics_equal_never(mode):
    assert_bitwise(train_once(mode, batch_norm=True), train_once("never", batch_norm=True))


@pytest.mark.parametrize("mode", ["selective:1", ["selective", "never", "except_last+selective"]], ids=str)
def test_selective_pytree_and_side_input_gradients_bitwise_equal_never(mode):
    assert_bitwise(run_tree(mode), run_tree("never"))
    assert_bitwise(run_masked(mode), run_masked("never"))


class CountMatmuls(TorchDispatchMode):
    """Counts the aten.addmm calls (a Linear's forward; its backward uses mm) that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.addmm = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.addmm += func.overloadpacket is torch.ops.aten.addmm
        return func(*args, **(kwargs or {}))


def forward_matmuls_in_backward(mode: str) -> int:
    """Linear forwards run during the backward pass (recomputes) of 4 layers, 4 micro-batches."""
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2], checkpoint=mode), chunks=4)
    out = engine.forward(torch.randn(8, 32)).sum()
    with CountMatmuls() as counter:
        out.backward()
    return counter.addmm


def test_selective_recomputes_no_matmul():
    assert forward_matmuls_in_backward("never") == 0
    assert forward_matmuls_in_backward("always") == 4 * 4
    assert forward_matmuls_in_backward("always:1") == 4 * 4
    assert forward_matmuls_in_backward("selective") == 0
    assert forward_matmuls_in_backward("selective:1") == 0


def test_selective_layers_of_a_module_pipeline_equal_never():
    """Under pipeline_of each layer call is its own checkpoint, here with SAC."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh()) for _ in range(4)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x) + x
            return x

    def grads(mode: Any) -> Dict[str, torch.Tensor]:
        model = Model()
        spec = pipeline_of(model, "blocks")
        runner = ModuleRunner(spec, plan(spec, devices=CPU, stages=2, checkpoint=mode), chunks=4)
        torch.manual_seed(1)
        try:
            model(torch.randn(8, 8, generator=torch.Generator().manual_seed(2))).pow(2).mean().backward()
        finally:
            runner.restore()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    assert_bitwise(grads(["selective", "except_last+selective"]), grads("never"))
