"""Measures each stage's peak memory of one local-engine training step on CPU.

All stages share the one CPU, so memory is attributed: every storage an operator creates belongs
to the stage running when it is created (forward: the stage whose forward runs; backward: the
stage whose backward began last, by a hook on each Stage's output). To measure what one device
per stage would hold, as the memory model predicts, a stage's input and its incoming gradient are
copied into the stage on arrival, as torchgpipe's Copy does between devices.

Counted like MemTracker counts (every storage an operator creates, by its bytes, until it is
freed): tests/memory/test_memory.py checks that the sum over stages agrees with MemTracker's own peak.
"""

import weakref
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import TorchDispatchMode, pop_dispatch_mode, push_dispatch_mode, tree_flatten
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import StagePlan


class StageTracker(TorchDispatchMode):
    """Live and peak bytes per stage of the storages created under it."""

    def __init__(self, stages: int) -> None:
        super().__init__()
        self.current = stages - 1
        self.live = [0] * stages
        self.peak = [0] * stages
        self.total_peak = 0
        self._seen: Dict[int, Any] = {}
        self.peak_op: List[str] = [""] * stages  # the operator at each stage's peak (for debugging)
        self.last_op = ""

    def exclude(self, tensors: Any) -> None:
        """Storages that exist before the step (parameters, buffers, the batch): views of them
        are not new memory."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, Tensor):
                st = t.untyped_storage()
                self._seen[id(st)] = st

    def _freed(self, key: int, stage: int, size: int) -> None:
        self._seen.pop(key, None)
        self.live[stage] -= size

    def adopt(self, value: Any) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, Tensor):
                st = t.untyped_storage()
                if id(st) not in self._seen:
                    size, stage = st.nbytes(), self.current
                    self._seen[id(st)] = weakref.ref(
                        st, lambda _, k=id(st), j=stage, n=size: self._freed(k, j, n)
                    )
                    self.live[stage] += size
        for j, v in enumerate(self.live):
            if v > self.peak[j]:
                self.peak[j] = v
                self.peak_op[j] = self.last_op
        self.total_peak = max(self.total_peak, sum(self.live))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.last_op = f"{func} in stage {self.current}"
        self.adopt(out)
        return out


def _copied(value: Any) -> Any:
    return tuple(t.clone() if isinstance(t, Tensor) and t.is_floating_point() else t for t in value)


def measure_local_step(
    sequential: nn.Sequential,
    plan: StagePlan,
    *,
    chunks: int,
    batch: Any,
    loss_fn: Callable[[Tensor], Tensor],
    seed: int = 0,
    forward_context: Callable[[], ContextManager[Any]] = nullcontext,
) -> Tuple[List[int], int]:
    """Per-stage peak bytes (parameters + everything the stage creates) of one forward and
    backward of ``LocalPipeline``, and the peak of the sum over stages. ``.grad`` is None before.
    ``forward_context``: what the forward and the loss run under, as a Trainer's step runs them (a
    mixed precision's autocast: ``pipeckpt.memory.precision.forward_context``); backward after it."""
    engine = LocalPipeline(sequential, plan, chunks=chunks, pin_memory=False)
    stages = engine.stages
    tracker = StageTracker(len(stages))
    tracker.exclude([*sequential.parameters(), *sequential.buffers(), batch])
    handles = []
    for stage in stages:

        def forward_pre(module: nn.Module, args: Tuple[Any, ...], j: int = stage.index) -> Any:
            tracker.current = j
            if j == 0:
                return None
            push_dispatch_mode(tracker)  # the worker thread: torchgpipe's, outside the stage's modes
            try:
                return _copied(args)
            finally:
                pop_dispatch_mode()

        def arriving(grad: Tensor, j: int = stage.index) -> Tensor:
            tracker.current = j
            # The last stage's gradient comes from the loss on its own device.
            return grad if j == len(stages) - 1 else grad.clone()

        def forward_post(
            module: nn.Module, args: Tuple[Any, ...], output: Any, hook: Callable[..., Tensor] = arriving
        ) -> None:
            # A hook on the output tensor, not a module backward hook: those keep the incoming
            # gradient alive until the whole stage's backward ends.
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(hook)

        handles.append(stage.register_forward_pre_hook(forward_pre))
        handles.append(stage.register_forward_hook(forward_post))
    sequential.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    try:
        with tracker:
            with forward_context():
                loss = loss_fn(engine.forward(batch))
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
    params = [sum(p.numel() * p.element_size() for p in stage.parameters()) for stage in stages]  # frozen too
    sequential.zero_grad(set_to_none=True)
    return [p + peak for p, peak in zip(params, tracker.peak)], tracker.total_peak


def measure_device_step(
    sequential: nn.Sequential,
    plan: StagePlan,
    *,
    chunks: int,
    batch: Any,
    loss_fn: Callable[[Tensor], Tensor],
    forward_context: Callable[[], ContextManager[Any]] = nullcontext,
) -> int:
    """The peak bytes of one ``LocalPipeline`` step with every stage on one device, parameters
    included, what existed before the step (the batch, a library's workspaces) not: on CUDA the
    allocator's ``max_memory_allocated`` over a step after a warm-up step, elsewhere every storage
    the step creates. ``forward_context`` as in :func:`measure_local_step`."""
    engine = LocalPipeline(sequential, plan, chunks=chunks, pin_memory=False)
    params = sum(p.numel() * p.element_size() for p in sequential.parameters())

    def step() -> None:
        with forward_context():
            loss = loss_fn(engine.forward(batch))
        loss.backward()
        del loss
        sequential.zero_grad(set_to_none=True)

    sequential.zero_grad(set_to_none=True)
    if not isinstance(batch, Tensor) or batch.device.type != "cuda":
        tracker = StageTracker(1)
        tracker.exclude([*sequential.parameters(), *sequential.buffers(), batch])
        with tracker:
            step()
        return params + tracker.total_peak
    step()  # warm-up: kernels' workspaces are allocated once, and are not the model's
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return params + torch.cuda.max_memory_allocated() - before


def split_batch(batch: Any, chunks: int) -> Any:
    """The first micro-batch of ``batch`` (as torchgpipe's scatter cuts it)."""
    if isinstance(batch, Tensor):
        return batch.chunk(chunks)[0]
    return type(batch)(t.chunk(chunks)[0] for t in batch)


__all__: Sequence[str] = ["StageTracker", "measure_device_step", "measure_local_step", "split_batch"]
