"""How many micro-batches a batch of each size runs as, under the distributed engine's schedule.

Why a module of its own: ``chunks`` equal micro-batches do not always fit (5 samples, chunks=4,
1F1B on 2 ranks), and the count must also meet the schedule's rule for its stages. The count is
found once per batch size (every batch but an epoch's last has the same), more and smaller
micro-batches are tried where ``chunks`` does not fit, and the train loader's last, smaller batch
is checked at the first step, so that a batch no count fits is refused before training rather
than at the end of the epoch.
"""

from typing import Any, Dict, List, Optional, Tuple

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler

from pipeckpt._errors import PipeckptConfigError, PipeckptWarning
from pipeckpt.engines.distributed.processes import ProcessGroups
from pipeckpt.engines.distributed.schedules import microbatch_rule
from pipeckpt.engines.distributed.topology import microbatches_for

__all__: List[str] = []


class MicrobatchCounts:
    """The micro-batch count of each batch size, found once; ``chunks`` where it fits."""

    def __init__(self, processes: ProcessGroups, chunks: int) -> None:
        self.processes, self.chunks = processes, chunks
        self._counts: Dict[Tuple[int, bool], int] = {}  # (batch size, train) -> micro-batches, as found
        self._warned = False
        self._last_batch_checked = False

    def of(self, size: int, train: bool) -> int:
        """The count for a batch of ``size`` samples (found once per size)."""
        m = self._counts.get((size, train))
        if m is None:
            m = self._counts[size, train] = self._count_for(size, train)
        return m

    def _count_for(self, size: int, train: bool) -> int:
        topology = self.processes.topology
        assert topology is not None
        try:
            m = microbatches_for(size, chunks=self.chunks, topology=topology, train=train)
        except PipeckptConfigError:
            # No count up to chunks fits (5 samples, chunks=4, 1F1B on 2 ranks): more, smaller
            # micro-batches may, each still equal (5 of 1 sample); else the refusal stands.
            def fits(m: int) -> bool:
                return size % m == 0 and not microbatch_rule(topology.kind, m, topology.pp, topology.stages)

            m = next(filter(fits, range(self.chunks + 1, size + 1)), 0)
            if not m:
                raise
        if m != self.chunks and not self._warned:
            self._warned = True
            rank_zero_warn(
                f"a batch of {size} samples cannot be cut into chunks={self.chunks} equal "
                f"micro-batches; it runs as {m} micro-batches (typically the last, smaller batch "
                "of an epoch). HINT: use a batch size that is a multiple of chunks, or drop_last=True",
                category=PipeckptWarning,
            )
        return m

    def check_last_batch(self, module: Any) -> None:
        """The train loader's last, smaller batch, cut into micro-batches at the first training step
        (later calls do nothing): one that no count of equal micro-batches fits is refused before
        training, not at the epoch's end."""
        if self._last_batch_checked:
            return
        self._last_batch_checked = True
        trainer = getattr(module, "_trainer", None)
        size = last_batch_size(trainer.train_dataloader) if trainer is not None else None
        if size:
            self.of(size, True)


def last_batch_size(loader: Any) -> Optional[int]:
    """The size of ``loader``'s last batch where it is smaller than the others, or None (none
    smaller, dropped, or a loader whose batches cannot be counted ahead)."""
    batches = getattr(loader, "batch_sampler", None)
    if not isinstance(batches, BatchSampler) or batches.drop_last or not isinstance(batches.batch_size, int):
        return None
    try:
        samples = len(batches.sampler)  # type: ignore[arg-type]
    except TypeError:  # a sampler without a length
        return None
    return samples % batches.batch_size or None
