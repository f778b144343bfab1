"""Offload: what a stage keeps for its recomputes, and where that lives.

``offload`` keeps each checkpointed micro-batch's stage input as a copy in (pinned) host memory
instead of on the stage's device. Only a CUDA stage offloads (a CPU stage's input is in host
memory already), and this machine has no GPU, so what CPU can show is split in three:

* which stages offload (mode x device; a Stage on a CUDA device is built without touching CUDA);
* what ``_offload`` makes of a tensor: a new host tensor, pinned memory asked of the allocator;
* the path through ``_Recompute`` with offloading turned on for a CPU stage: each input goes
  through ``_offload``, the autograd node keeps only the host copy, backward brings it back.

That device memory is really freed is measured on a GPU in tests/test_cuda.py.
"""

from typing import Any, List, Tuple

import pytest
import torch
from torch import Tensor, nn

import pipeckpt.stage as stage_module
from pipeckpt import ALWAYS, EXCEPT_LAST, NEVER, OFFLOAD
from pipeckpt.engines.distributed.wiring import build_stages
from pipeckpt.engines.local_pipeline import LocalPipeline
from pipeckpt.planning import plan
from pipeckpt.stage import Stage

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 8))


@pytest.mark.parametrize(
    "mode, device, offloads",
    [
        (OFFLOAD, CUDA, True),
        (OFFLOAD, CPU, False),
        (ALWAYS, CUDA, False),
        (EXCEPT_LAST, CUDA, False),
        (NEVER, CUDA, False),
    ],
    ids=["offload-cuda", "offload-cpu", "always-cuda", "except_last-cuda", "never-cuda"],
)
def test_only_an_offloading_mode_on_a_cuda_stage_offloads(mode, device, offloads):
    assert Stage(layers(), index=0, mode=mode, device=device).offloads is offloads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_offload_copies_the_input_into_a_new_host_tensor(dtype):
    x = torch.randn(4, 8).mul(10).to(dtype)
    host = stage_module._offload(x, pin_memory=False)
    assert (host.device, host.dtype, host.shape) == (CPU, x.dtype, x.shape)
    assert torch.equal(host, x)
    assert host.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("pin_memory", [True, False])
def test_offload_asks_the_allocator_for_pinned_memory_exactly_when_pin_memory_is_set(monkeypatch, pin_memory):
    # CPU-only torch refuses pinned allocations, so a spy on torch.empty records the request and
    # allocates pageable memory; tests/test_cuda.py checks the real pinned tensor on a GPU.
    requested: List[Any] = []
    empty = torch.empty

    def spy(*args: Any, **kwargs: Any) -> Tensor:
        requested.append(kwargs.get("pin_memory"))
        return empty(*args, **{**kwargs, "pin_memory": False})

    monkeypatch.setattr(torch, "empty", spy)
    stage_module._offload(torch.randn(4, 8), pin_memory=pin_memory)
    assert requested == [pin_memory]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_of_a_cuda_tensor_lands_in_pinned_host_memory():
    x = torch.randn(4, 8, device="cuda")
    host = stage_module._offload(x, pin_memory=True)
    torch.cuda.synchronize()
    assert host.device == CPU and host.is_pinned() and torch.equal(host, x.cpu())


class Offloads:
    """Turns offloading on for a CPU stage and records every call of ``_offload``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: List[Tuple[Tensor, bool, Tensor]] = []  # (input, pin_memory, host copy)
        real = stage_module._offload

        def spy(x: Tensor, pin_memory: bool) -> Tensor:
            host = real(x, pin_memory=False)  # CPU-only torch cannot pin
            self.calls.append((x, pin_memory, host))
            return host

        monkeypatch.setattr(stage_module, "_offload", spy)
        monkeypatch.setattr(Stage, "offloads", property(lambda stage: stage.mode.offloads))


def microbatches(stage: Stage, n: int = 3) -> Tuple[List[Tensor], List[Tensor]]:
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 8, generator=g).requires_grad_() for _ in range(n)]
    stage.begin_step(n)
    torch.manual_seed(2)
    return inputs, [stage(x) for x in inputs]


@pytest.mark.parametrize("pin_memory", [True, False])
def test_an_offloading_stage_hands_each_input_to_offload_with_its_pin_memory(monkeypatch, pin_memory):
    spy = Offloads(monkeypatch)
    inputs, _ = microbatches(Stage(layers(), index=0, mode=OFFLOAD, device=CPU, pin_memory=pin_memory))
    assert [x for x, _, _ in spy.calls] == inputs  # each micro-batch's input once, in order
    assert all(x is given for (x, _, _), given in zip(spy.calls, inputs))
    assert [pin for _, pin, _ in spy.calls] == [pin_memory] * 3


def test_an_offloading_stage_keeps_only_the_host_copy_until_backward(monkeypatch):
    spy = Offloads(monkeypatch)
    _, outputs = microbatches(Stage(layers(), index=0, mode=OFFLOAD, device=CPU))
    for out, (_, _, host) in zip(outputs, spy.calls):
        node = out.grad_fn  # a custom Function's node is its ctx
        assert node.saved_tensors == ()
        assert len(node.offloaded) == 1 and node.offloaded[0] is host
    torch.stack(outputs).sum().backward()
    assert all(out.grad_fn.offloaded is None for out in outputs)  # the host copies are let go


def test_a_stage_that_does_not_offload_saves_its_input_for_backward(monkeypatch):
    spy = Offloads(monkeypatch)
    inputs, outputs = microbatches(Stage(layers(), index=0, mode=ALWAYS, device=CPU))
    assert spy.calls == []
    for x, out in zip(inputs, outputs):
        assert out.grad_fn.offloaded is None
        (saved,) = out.grad_fn.saved_tensors
        assert torch.equal(saved, x)


def test_an_offloading_stage_gives_the_gradients_of_never_bitwise(monkeypatch):
    def grads(mode) -> List[Tensor]:
        stage = Stage(layers(), index=0, mode=mode, device=CPU)
        inputs, outputs = microbatches(stage)
        torch.stack(outputs).pow(2).sum().backward()
        return [x.grad for x in inputs] + [p.grad for p in stage.parameters()]

    reference = grads(NEVER)
    spy = Offloads(monkeypatch)
    offloaded = grads(OFFLOAD)
    assert len(spy.calls) == 3
    assert all(torch.equal(a, b) for a, b in zip(reference, offloaded))


def test_the_local_engine_gives_every_stage_its_pin_memory():
    seq = layers()
    for pin_memory in (True, False):
        p = plan(seq, devices=[CPU], balance=[2, 2], checkpoint="offload")
        engine = LocalPipeline(seq, p, chunks=2, pin_memory=pin_memory)
        assert [s.pin_memory for s in engine.stages] == [pin_memory, pin_memory]


def test_the_distributed_engine_gives_every_stage_its_pin_memory():
    seq = layers()
    p = plan(seq, devices=[CPU], balance=[2, 2], checkpoint="offload")
    for pin_memory in (True, False):
        stages = build_stages(seq, p, [0, 1], device=CPU, pin_memory=pin_memory, entry=None)
        assert [s.stage.pin_memory for s in stages] == [pin_memory, pin_memory]


def test_the_strategy_setting_reaches_every_stage():
    from toy import ToyModule, fit

    from pipeckpt import PipelineStrategy

    for pin_memory in (True, False):
        strategy = PipelineStrategy(stages=2, checkpoint="offload", pin_memory=pin_memory)
        trainer = fit(ToyModule(), strategy, steps=1)
        assert [s.pin_memory for s in trainer.strategy.stages] == [pin_memory, pin_memory]
