"""The peak of a step's bytes as torch's CPU allocator saw them: inside every operator, DTensor's too.

Why a second count beside :class:`harness.live_bytes.LiveBytes`: that one is a
``TorchDispatchMode``, and a mode is off while its own handler runs an operator. An operator on
DTensors reaches it as one call; the local operators DTensor runs beneath it are not seen, only the
DTensor's result. Under tensor parallelism those are real bytes: ``loss_parallel``'s log-softmax
makes ``x - max`` and its ``exp`` beside the logits, and its backward a zeroed tensor, an ``exp``
and their sum, each shaped like the logits' shard (torch/distributed/tensor/parallel/loss.py); a
redistribution makes its collective's buffers. So are the buffers an aten kernel makes and frees
inside itself. Measured on every saved row (benchmarks/RESULTS_layout.md, "What the operator count
cannot see").

How: torch's profiler with ``profile_memory`` hears every allocation and free of the CPU allocator
(c10's ``ProfiledCPUMemoryReporter``) of a storage allocated while it profiles, with its bytes: the
free of one allocated before is not heard. So it runs from a whole step before the one counted
(:class:`harness.layout_fit.Probe`): what a step frees was made in it or in the step before (the
gradients, FSDP2's gathered parameters, the batch), or is never freed (parameters and optimizer
state are updated in place). Run from before the model was built instead, its record of every
operator of the fit held 3.3 GB a process, and a rank of a 4-process run died without an error
(killed, by the look of it: not traced). The step is marked
by two sentinel allocations of sizes nothing else has. Its peak is what :class:`LiveBytes` counted
as it began (parameters, gradients, optimizer state, the batch, the receive buffers) plus the most
bytes the allocator held above its level at the first sentinel, until the second.
"""

from typing import Any, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocatedBytes", "peak_between"]

SENTINELS = (1_000_003, 1_000_033)  # bytes: prime, so that no tensor of the step has either size


def peak_between(events: List[Tuple[int, int]], sentinels: Tuple[int, int] = SENTINELS) -> int:
    """The most bytes held above the level after the first sentinel's free, before the second
    sentinel's allocation, in ``events``: (time, bytes) of each allocation (> 0) and free (< 0) in
    time order."""
    level, start, peak = 0, None, 0
    for _, nbytes in events:
        if start is None:
            level += nbytes
            if nbytes == -sentinels[0]:
                start = level
            continue
        if nbytes == sentinels[1]:
            return peak
        level += nbytes
        peak = max(peak, level - start)
    raise RuntimeError(f"the step's sentinels ({sentinels[0]}, {sentinels[1]} bytes) were not both seen")


class AllocatedBytes:
    """The CPU allocator's events while it is entered (torch's profiler with ``profile_memory``);
    :meth:`mark` ``(0)`` and ``(1)`` bound the step, :meth:`peak` is its most bytes above the first."""

    def __init__(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> "AllocatedBytes":
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profile.__exit__(*exc)

    @staticmethod
    def mark(which: int) -> None:
        """Allocates and frees the sentinel ``which`` (0: the step begins, 1: it has ended)."""
        torch.empty(SENTINELS[which], dtype=torch.uint8)

    def events(self) -> List[Tuple[int, int]]:
        """(time, bytes) of each allocation (> 0) and free (< 0) heard, in time order (after
        :meth:`__exit__`)."""
        results = self._profile.profiler.kineto_results  # type: ignore[union-attr]
        return sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")

    def peak(self) -> int:
        """The step's most bytes above the allocator's level as it began (after :meth:`__exit__`)."""
        return peak_between(self.events())
