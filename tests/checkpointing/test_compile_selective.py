"""Selective checkpointing under the ``compile`` setting: each layer of a selective stage is compiled
with SAC's checkpoint inside (pipeckpt/checkpointing/compiling.py), so the policy decides at graph
partitioning, once, and a step dispatches no op through Python. Gradients stay bitwise equal to
``never`` and to eager selective, on the bundled toy model and on Hugging Face GPT-2 through
``pipeline_of``. Run under the ``aot_eager`` backend (no C++ compiler, seconds; what it keeps
exact: tests/checkpointing/test_compile.py)."""

import warnings
from typing import Any, Dict, List

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from support.hf_zoo import hf_data, hf_module
from support.toy import ToyModule, assert_bitwise_equal, fit, params
from torch import Tensor
from torch._dynamo.utils import counters

from pipeckpt import PipelineStrategy
from pipeckpt.checkpointing import selective as sac


def pipe(mode: str, compile: Any = "aot_eager", **kwargs: Any) -> PipelineStrategy:
    return PipelineStrategy(balance=[3, 3], chunks=2, checkpoint=mode, compile=compile, **kwargs)


class PolicyCalls(Callback):
    """How many times SAC's policy ran by the end of each training step."""

    def __init__(self) -> None:
        self.after_step: List[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, *args: Any) -> None:
        self.after_step.append(calls[0])


calls = [0]


@pytest.fixture
def counted_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls[0] = 0
    policy = sac.policy

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return policy(*args, **kwargs)

    monkeypatch.setattr(sac, "policy", counting)


def trained_toy(strategy: PipelineStrategy) -> Dict[str, Tensor]:
    """Parameters and BatchNorm statistics after 3 steps with dropout on."""
    return params(fit(ToyModule(dropout=0.3, batch_norm=True), strategy, steps=3).lightning_module)


@pytest.mark.parametrize("mode", ["selective", "selective:1", "except_last+selective"])
def test_compiled_selective_trains_bitwise_equal_to_never_and_to_eager_selective(mode: str) -> None:
    never = trained_toy(pipe("never", False))
    eager = trained_toy(pipe(mode, False))
    torch.compiler.reset()  # compile afresh, not from an earlier test's cache
    counters.clear()
    compiled = trained_toy(pipe(mode))
    assert counters["frames"]["ok"] > 0  # Dynamo did compile the layers
    assert_bitwise_equal(compiled, never)
    assert_bitwise_equal(compiled, eager)


def test_compiled_selective_asks_the_policy_while_compiling_eager_every_step(counted_policy: None) -> None:
    torch.compiler.reset()
    counters.clear()
    record = PolicyCalls()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*compiled layer ran eagerly")  # Dynamo gave up on none
        fit(ToyModule(), pipe("selective"), steps=3, callbacks=[record])
    first, *later = record.after_step
    assert first > 0  # the partitioner asked the policy about the layers' ops
    assert later == [first, first]  # and nothing asked it again: no per-op dispatch in a step
    assert not counters["graph_break"]  # the checkpoint is one region of each layer's graph
    eager = PolicyCalls()
    calls[0] = 0
    fit(ToyModule(), pipe("selective", False), steps=3, callbacks=[eager])
    first, second, third = eager.after_step
    assert third - second == second - first > 0  # eager SAC asks again every step: the host cost


def trained_gpt2(quiet_trainer: Any, mode: str, compile: Any) -> Dict[str, Tensor]:
    module = hf_module("gpt2", dropout=0.1)
    strategy = PipelineStrategy(stages=2, chunks=4, checkpoint=mode, compile=compile)
    torch.manual_seed(7)
    quiet_trainer(strategy, max_steps=2).fit(module, hf_data())
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_compiled_selective_trains_hf_gpt2_bitwise_equal_to_never(quiet_trainer: Any) -> None:
    never = trained_gpt2(quiet_trainer, "never", False)
    compiled = trained_gpt2(quiet_trainer, "selective", "aot_eager")
    assert_bitwise_equal(compiled, never)
