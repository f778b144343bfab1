"""Offload: what a stage keeps for its recomputes, where that lives, and when it comes back.

``offload`` keeps each checkpointed call's inputs in (pinned) host memory, copied out and back
by a stream layer (``pipeckpt.checkpointing.offload.Copies``), and in backward issues the copy back of the
next entry before the current one recomputes. Only a CUDA stage offloads, and this machine has
no GPU, so CPU shows:

* which stages offload (mode x device; a Stage on a CUDA device is built without touching CUDA);
* what the CPU copy layer makes of a tensor: a new host tensor, pinned memory asked for;
* the path through ``_Recompute`` with offloading turned on for a CPU stage and a recording
  copy layer injected: what goes out, what the autograd node keeps, what the recompute runs
  on, and the order of copies out, copies back ("prefetch"), uses and recomputes.

That device memory is really freed, and the copies run on side streams, is checked on a GPU
in tests/test_cuda.py.
"""

from typing import Any, List, Tuple

import pytest
import torch
from torch import Tensor, nn

from pipeckpt import ALWAYS, EXCEPT_LAST, NEVER, OFFLOAD
from pipeckpt.checkpointing.modes import parse_mode
from pipeckpt.checkpointing.offload import HostCopies, Offloader, Parked, copies_for
from pipeckpt.checkpointing.order import gpipe_order
from pipeckpt.engines.distributed.wiring import build_stages
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan
from pipeckpt.stages.recompute import Recomputable
from pipeckpt.stages.stage import Stage

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
Event = Tuple[str, int]  # ("offload" | "prefetch" | "use", entry) or ("recompute", -1)


class Logged(nn.Module):
    """A layer that logs each recompute (a run with grad on: the Function's forward runs without)
    and the tensor it ran on."""

    def __init__(self, inner: nn.Module, log: List[Event], seen: List[Tensor]) -> None:
        super().__init__()
        self.inner, self.log, self.seen = inner, log, seen

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            self.log.append(("recompute", -1))
            self.seen.append(x)
        return self.inner(x)


class RecordingCopies:
    """A copy layer that logs every call, entry ``k`` being the k-th tensor sent out, and keeps
    what it received and returned. It copies as the CPU layer does (without pinning: CPU-only
    torch refuses pinned memory), and hands back a fresh tensor from every copy back."""

    def __init__(self, log: List[Event]) -> None:
        self.log = log
        self.received: List[Tensor] = []
        self.pins: List[bool] = []
        self.hosts: List[Tensor] = []
        self.returned: List[Tensor] = []

    def to_host(self, x: Tensor, *, pin_memory: bool) -> Tuple[int, Tensor]:
        k = len(self.received)
        self.received.append(x)
        self.pins.append(pin_memory)
        self.hosts.append(HostCopies().to_host(x, pin_memory=False))
        self.log.append(("offload", k))
        return k, self.hosts[-1]

    def to_device(self, stored: Tuple[int, Tensor], device: torch.device) -> Tuple[int, Tensor]:
        k, host = stored
        self.log.append(("prefetch", k))
        return k, host.to(device).clone()

    def use(self, fetched: Tuple[int, Tensor]) -> Tensor:
        k, tensor = fetched
        self.log.append(("use", k))
        self.returned.append(tensor)
        return tensor


class Rig:
    """A CPU stage with offloading turned on and a recording copy layer."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, mode: Any = OFFLOAD, *, pin_memory: bool = True, depth: int = 2
    ) -> None:
        monkeypatch.setattr(Recomputable, "offloads", property(lambda stage: stage.mode.offloads))
        self.log: List[Event] = []
        self.seen: List[Tensor] = []
        torch.manual_seed(0)
        body = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3)) for _ in range(depth)]
        layers = nn.Sequential(*[Logged(layer, self.log, self.seen) for layer in body])
        mode = parse_mode(mode) if isinstance(mode, str) else mode
        self.stage = Stage(layers, index=0, mode=mode, device=CPU, pin_memory=pin_memory)
        # Logged keeps the tensors its layers ran on, to compare them by identity: a side channel the
        # first step's check refuses (stages/escapes.py), so this rig goes without it.
        self.stage._watching = False
        self.copies = RecordingCopies(self.log)
        self.stage.copies = self.copies

    def forward(self, n: int = 3, *, order: Any = None) -> Tuple[List[Tensor], List[Tensor]]:
        return microbatches(self.stage, n, order=order)


def microbatches(stage: Stage, n: int = 3, *, order: Any = None) -> Tuple[List[Tensor], List[Tensor]]:
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 8, generator=g).requires_grad_() for _ in range(n)]
    stage.begin_step(n, order=order)
    torch.manual_seed(2)
    return inputs, [stage(x) for x in inputs]


def backward_log(log: List[Event]) -> List[Event]:
    return log[next(i for i, e in enumerate(log) if e[0] != "offload") :]


# -- which stages offload, and the CPU copy layer ---------------------------------------------


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
    stage = Stage(nn.Sequential(nn.Linear(8, 8)), index=0, mode=mode, device=device)
    assert stage.offloads is offloads


def test_a_cpu_stage_gets_the_copy_layer_that_copies_at_once():
    assert isinstance(copies_for(CPU), HostCopies)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_the_cpu_copy_layer_copies_into_a_new_host_tensor_and_back(dtype):
    x = torch.randn(4, 8).mul(10).to(dtype)
    copies = HostCopies()
    host = copies.to_host(x, pin_memory=False)
    assert (host.device, host.dtype, host.shape) == (CPU, x.dtype, x.shape)
    assert torch.equal(host, x)
    assert host.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert copies.use(copies.to_device(host, CPU)) is host  # CPU to CPU: nothing to copy


@pytest.mark.parametrize("pin_memory", [True, False])
def test_the_cpu_copy_layer_asks_for_pinned_memory_exactly_when_pin_memory_is_set(monkeypatch, pin_memory):
    # CPU-only torch refuses pinned allocations, so a spy on torch.empty records the request and
    # allocates pageable memory; tests/test_cuda.py checks the real pinned tensor on a GPU.
    requested: List[Any] = []
    empty = torch.empty

    def spy(*args: Any, **kwargs: Any) -> Tensor:
        requested.append(kwargs.get("pin_memory"))
        return empty(*args, **{**kwargs, "pin_memory": False})

    monkeypatch.setattr(torch, "empty", spy)
    HostCopies().to_host(torch.randn(4, 8), pin_memory=pin_memory)
    assert requested == [pin_memory]


# -- what goes out, what the node keeps, what the recompute runs on ----------------------------


@pytest.mark.parametrize("pin_memory", [True, False])
def test_an_offloading_stage_sends_each_input_out_once_in_order_with_its_pin_memory(monkeypatch, pin_memory):
    rig = Rig(monkeypatch, pin_memory=pin_memory)
    inputs, _ = rig.forward()
    assert len(rig.copies.received) == 3
    assert all(x is given for x, given in zip(rig.copies.received, inputs))
    assert rig.copies.pins == [pin_memory] * 3


def test_an_offloading_stage_keeps_only_the_host_copy_until_backward(monkeypatch):
    rig = Rig(monkeypatch)
    _, outputs = rig.forward()
    for k, out in enumerate(outputs):
        node = out.grad_fn  # a custom Function's node is its ctx
        assert node.saved_tensors == ()
        assert isinstance(node.offloaded, Parked) and node.offloaded.microbatch == k
        assert node.offloaded.stored == [(k, rig.copies.hosts[k])]
    torch.stack(outputs).sum().backward()
    assert all(out.grad_fn.offloaded is None for out in outputs)  # the host copies are let go


def test_the_recompute_runs_on_the_tensor_the_copy_layer_brought_back(monkeypatch):
    rig = Rig(monkeypatch, depth=1)
    inputs, outputs = rig.forward()
    torch.stack(outputs).sum().backward()
    assert len(rig.seen) == 3
    assert all(ran is back for ran, back in zip(rig.seen, rig.copies.returned))
    # Backward runs from the last micro-batch: the first tensor back is micro-batch 2's.
    for ran, original in zip(rig.seen, reversed(inputs)):
        assert ran is not original and torch.equal(ran, original)


def test_a_stage_that_does_not_offload_saves_its_input_for_backward(monkeypatch):
    rig = Rig(monkeypatch, ALWAYS)
    inputs, outputs = rig.forward()
    assert rig.copies.received == []
    for x, out in zip(inputs, outputs):
        assert out.grad_fn.offloaded is None
        (saved,) = out.grad_fn.saved_tensors
        assert torch.equal(saved, x)


# -- when entries come back ------------------------------------------------------------------


def test_backward_prefetches_the_next_microbatch_before_the_current_one_recomputes(monkeypatch):
    rig = Rig(monkeypatch, depth=1)
    _, outputs = rig.forward(3)
    torch.stack(outputs).sum().backward()  # the local engine's order: micro-batch 2, 1, 0
    assert rig.log[:3] == [("offload", 0), ("offload", 1), ("offload", 2)]
    assert backward_log(rig.log) == [
        ("prefetch", 2),  # asked for first: nothing was on its way yet
        ("prefetch", 1),
        ("use", 2),
        ("recompute", -1),
        ("prefetch", 0),
        ("use", 1),
        ("recompute", -1),
        ("use", 0),
        ("recompute", -1),
    ]


def test_per_layer_offload_prefetches_the_segment_before_and_then_the_next_microbatch(monkeypatch):
    rig = Rig(monkeypatch, "offload:1", depth=2)
    _, outputs = rig.forward(2)
    torch.stack(outputs).sum().backward()
    # Entries in forward order: 0 = (mb 0, layer 0), 1 = (mb 0, layer 1), 2 = (mb 1, 0), 3 = (mb 1, 1).
    assert rig.log[:4] == [("offload", k) for k in range(4)]
    assert backward_log(rig.log) == [
        ("prefetch", 3),
        ("prefetch", 2),
        ("use", 3),
        ("recompute", -1),
        ("prefetch", 1),
        ("use", 2),
        ("recompute", -1),
        ("prefetch", 0),
        ("use", 1),
        ("recompute", -1),
        ("use", 0),
        ("recompute", -1),
    ]


def test_prefetch_follows_the_schedule_order_given_to_the_step(monkeypatch):
    rig = Rig(monkeypatch, depth=1)
    _, outputs = rig.forward(3, order=gpipe_order(0, 3))  # backward from micro-batch 0
    for out in outputs:  # run backward in that order
        out.sum().backward()
    assert backward_log(rig.log) == [
        ("prefetch", 0),
        ("prefetch", 1),
        ("use", 0),
        ("recompute", -1),
        ("prefetch", 2),
        ("use", 1),
        ("recompute", -1),
        ("use", 2),
        ("recompute", -1),
    ]


def test_a_backward_order_other_than_the_schedule_said_copies_each_entry_back_once_before_use(monkeypatch):
    rig = Rig(monkeypatch, depth=1)
    _, outputs = rig.forward(3, order=gpipe_order(0, 3))  # predicts 0, 1, 2 ...
    torch.stack(outputs).sum().backward()  # ... but backward runs 2, 1, 0
    events = backward_log(rig.log)
    assert sorted(k for kind, k in events if kind == "prefetch") == [0, 1, 2]
    assert [k for kind, k in events if kind == "use"] == [2, 1, 0]
    for k in range(3):
        assert events.index(("prefetch", k)) < events.index(("use", k))


def test_an_offloader_prefetches_as_many_entries_ahead_as_asked():
    log: List[Event] = []
    offloader = Offloader(RecordingCopies(log), pin_memory=False, ahead=2)
    offloader.begin_step([3, 2, 1, 0])
    entries = [offloader.park(m, [torch.full((2,), float(m))]) for m in range(4)]
    (back,) = offloader.fetch(entries[3])
    assert torch.equal(back, torch.full((2,), 3.0))
    assert log[4:] == [("prefetch", 3), ("prefetch", 2), ("prefetch", 1), ("use", 3)]


def test_entries_left_by_a_step_without_backward_are_let_go_when_the_next_step_begins(monkeypatch):
    rig = Rig(monkeypatch, depth=1)
    rig.forward(3)
    offloader = rig.stage._offloader()
    assert len(offloader._waiting) == 3
    rig.stage.begin_step(3)
    assert offloader._waiting == []


# -- gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["offload", "offload:1"])
@pytest.mark.parametrize("copies", ["recording", "cpu"])
def test_an_offloading_stage_gives_the_gradients_of_never_bitwise(monkeypatch, mode, copies):
    def grads(stage: Stage) -> List[Tensor]:
        inputs, outputs = microbatches(stage)
        torch.stack(outputs).pow(2).sum().backward()
        return [x.grad for x in inputs] + [p.grad for p in stage.parameters()]

    reference = grads(Rig(monkeypatch, NEVER).stage)
    rig = Rig(monkeypatch, mode, pin_memory=copies != "cpu")  # CPU-only torch cannot pin
    if copies == "cpu":
        rig.stage.copies = None  # the device's own: HostCopies
    offloaded = grads(rig.stage)
    assert len(rig.stage._offloader()._waiting) == 0  # every entry came back
    assert all(torch.equal(a, b) for a, b in zip(reference, offloaded))


# -- the setting reaches every stage ---------------------------------------------------------


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 8))


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
    from support.toy import ToyModule, fit

    from pipeckpt import PipelineStrategy

    for pin_memory in (True, False):
        strategy = PipelineStrategy(stages=2, checkpoint="offload", pin_memory=pin_memory)
        trainer = fit(ToyModule(), strategy, steps=1)
        assert [s.pin_memory for s in trainer.strategy.stages] == [pin_memory, pin_memory]
