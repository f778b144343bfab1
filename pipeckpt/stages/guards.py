"""What a recompute restores so that it replays its forward exactly.

Module state: BatchNorm running statistics are put back after the rerun, and torchgpipe's
``is_recomputing`` flag is set so that its DeferredBatchNorm does not track twice. Random
state: the CPU and device generators and the micro-batch's per-layer streams
(:mod:`pipeckpt.checkpointing.layer_rng`) as they were at the forward.
"""

from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence

import torch
from torch import nn

from pipeckpt._compat import BatchNormBase, gpipe_flags
from pipeckpt.checkpointing.layer_rng import LayerStreams

__all__ = ["Recomputing", "RngState", "batch_norms", "side_effect_free"]


def batch_norms(partition: nn.Module) -> List[nn.Module]:
    """The BatchNorm layers of ``partition`` that track running statistics."""
    return [m for m in partition.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]


class Recomputing:
    """torchgpipe's ``is_recomputing`` flag for a ``with`` block. A class rather than torchgpipe's
    generator context manager: a dispatch-bound stage enters it once per recomputed micro-batch."""

    __slots__ = ("was",)

    def __enter__(self) -> None:
        self.was = gpipe_flags.is_recomputing
        gpipe_flags.is_recomputing = True

    def __exit__(self, *_: Any) -> None:
        gpipe_flags.is_recomputing = self.was


@contextmanager
def side_effect_free(partition: nn.Module, norms: Optional[Sequence[nn.Module]] = None) -> Iterator[None]:
    """A recompute must leave module state as the first forward left it:
    BatchNorm running statistics are restored, and torchgpipe's
    DeferredBatchNorm is told it is recomputing so it does not track twice.

    Args:
        partition: the layers that rerun.
        norms: their tracking BatchNorm layers, when the caller has them already.
    """
    norms = batch_norms(partition) if norms is None else norms
    if not norms:
        with Recomputing():
            yield
        return
    saved = [{k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None} for m in norms]
    try:
        with Recomputing():
            yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for k, b in buffers.items():
                    getattr(m, k).copy_(b)


class RngState:
    """The CPU and (for a CUDA stage) device RNG states at a checkpointed forward, and the
    micro-batch whose per-layer streams the stage was running.

    Args:
        device: the CUDA device whose generator is saved too; None: the CPU's only.
        streams: the stage's per-layer random streams, when the engine set them.
    """

    __slots__ = ("cpu", "cuda", "device", "microbatch", "streams")

    def __init__(self, device: Optional[torch.device], streams: Optional[LayerStreams] = None) -> None:
        # The default generator's own methods: torch.get_rng_state/set_rng_state only wrap them.
        self.cpu = torch.default_generator.get_state()
        self.device = device
        self.cuda = torch.cuda.get_rng_state(device) if device is not None else None
        self.streams = streams
        self.microbatch = streams.current() if streams is not None else None

    def restore(self) -> None:
        torch.default_generator.set_state(self.cpu)
        if self.device is not None and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        if self.streams is not None:
            self.streams.set_current(self.microbatch)
