"""One pipeline stage: a partition of the user's layers run under its mode.

Why not torchgpipe's own checkpointing: it has one global mode, no offload,
and it recomputes *ahead* of the gradient, so on one device several
micro-batches' recomputed activations are alive at once. Here a stage
checkpoints with ``torch.utils.checkpoint`` (non-reentrant): recompute starts
only when the stage's gradient arrives, the autograd graph keeps the exact
topology of an uncheckpointed run (so gradients accumulate in the same order
and stay bitwise equal), and the CPU/CUDA RNG state is replayed for dropout.
``offload`` wraps that in ``torch.autograd.graph.save_on_cpu`` so the one
tensor a checkpoint keeps, the stage input, waits in pinned host memory.

Engines run stages in threads they own (torchgpipe's workers). Autocast and
torch dispatch modes (``FlopCounterMode``, ``MemTracker``, debug modes) are
thread-local, so the engine captures the caller's with
:func:`capture_caller_state` and the stage re-enters them around its forward:
``bf16-mixed`` computes the stages in bf16, and a user's FLOP counter or
memory tracker sees the stages' work. Checkpoint replays autocast in the
recompute, which runs on the caller's (autograd) thread.
"""

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pipeckpt._compat import (
    BatchNormBase,
    TorchDispatchMode,
    dispatch_mode_stack,
    enable_checkpointing,
    enable_recomputing,
    pop_dispatch_mode,
    push_dispatch_mode,
)
from pipeckpt.modes import CheckpointMode

__all__ = ["Stage", "CallerState", "capture_caller_state", "side_effect_free"]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class CallerState:
    """Thread-local state of the thread that called the pipeline."""

    autocast: Tuple[Tuple[str, torch.dtype], ...] = ()
    dispatch_modes: Tuple[TorchDispatchMode, ...] = ()

    @contextmanager
    def applied(self) -> Iterator[None]:
        # Modes already on this thread's stack (the caller's own thread) stay as they are.
        present = {id(m) for m in dispatch_mode_stack()}
        pushed = [m for m in self.dispatch_modes if id(m) not in present]
        for mode in pushed:
            push_dispatch_mode(mode)
        try:
            with ExitStack() as stack:
                for device_type, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                yield
        finally:
            for _ in pushed:
                pop_dispatch_mode()


def capture_caller_state() -> CallerState:
    enabled = []
    for device_type in _AUTOCAST_DEVICE_TYPES:
        if torch.is_autocast_enabled(device_type):
            enabled.append((device_type, torch.get_autocast_dtype(device_type)))
    return CallerState(autocast=tuple(enabled), dispatch_modes=tuple(dispatch_mode_stack()))


@contextmanager
def side_effect_free(partition: nn.Module) -> Iterator[None]:
    """A recompute must leave module state as the first forward left it:
    BatchNorm running statistics are restored, and torchgpipe's
    DeferredBatchNorm is told it is recomputing so it does not track twice."""
    norms = [m for m in partition.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]
    saved = [{k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None} for m in norms]
    try:
        with enable_recomputing():
            yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for k, b in buffers.items():
                    getattr(m, k).copy_(b)


class Stage(nn.Module):
    """A partition of the user's layers, its device and its checkpoint mode.

    The engine calls :meth:`begin_step` before each pipelined forward; every
    engine feeds a stage its micro-batches in order, so a call counter tells
    the stage which micro-batch it runs (``except_last`` needs that).
    """

    def __init__(
        self,
        partition: nn.Sequential,
        *,
        index: int,
        mode: CheckpointMode,
        device: torch.device,
        pin_memory: bool = True,
    ) -> None:
        super().__init__()
        self.partition = partition
        self.index = index
        self.mode = mode
        self.device = device
        self.pin_memory = pin_memory
        self.forward_calls = 0  # runs of the partition, recomputes included
        self._microbatch = 0
        self._num_microbatches = 1
        self._caller = CallerState()

    def begin_step(self, num_microbatches: int, caller: CallerState = CallerState()) -> None:
        self._microbatch = 0
        self._num_microbatches = num_microbatches
        self._caller = caller

    def forward(self, input: Tensor) -> Tensor:
        i = self._microbatch
        self._microbatch += 1
        with self._caller.applied():
            if torch.is_grad_enabled() and self.mode.recomputes(i, self._num_microbatches):
                return self._checkpointed(input)
            return self._run(input)

    def _run(self, input: Tensor) -> Tensor:
        self.forward_calls += 1
        return self.partition(input)

    def _checkpointed(self, input: Tensor) -> Tensor:
        def contexts() -> Tuple[ExitStack, object]:
            return enable_checkpointing(), side_effect_free(self.partition)

        with ExitStack() as stack:
            if self.mode.offloads and self.device.type != "cpu":
                stack.enter_context(
                    torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory, device_type=self.device.type)
                )
            return checkpoint(
                self._run, input, use_reentrant=False, preserve_rng_state=True, context_fn=contexts
            )

    def extra_repr(self) -> str:
        return f"index={self.index}, mode={self.mode.name}, device={self.device}"


def stage_modules(stages: List[Stage]) -> List[nn.Sequential]:
    """The user's partitions, e.g. for torchgpipe's skip-layout inspection."""
    return [s.partition for s in stages]
