"""A training loader that a checkpoint resumes where it stopped: the next unseen batch, not the
epoch's first.

Lightning saves the ``state_dict`` of a training loader that has one (``state_dict`` and
``load_state_dict``) into the checkpoint and hands it back on resume, before it draws the first
batch; without one it warns that the loader is not resumable and replays the epoch. The state here
is what fixes the order (the shuffle's seed and epoch) and how many batches were drawn. A loader over
a dataset with a length is not prefetched by Lightning, so the count drawn is the count trained on.

Why not ``torchdata``'s ``StatefulDataLoader``: one more dependency for three numbers; and its state
depends on the replica it was saved on, where this one is the same on every replica (each replica
skips as many of its own batches), so a checkpoint written by rank 0 resumes every replica.

The sampler is a ``DistributedSampler``, so Lightning leaves it in place (it would wrap any other
sampler in its own, which keeps no state); ``num_replicas`` and ``rank`` are the strategy's data-
parallel ones, under which all stages of one pipeline read the same batches.
"""

from typing import Any, Dict, Iterator, Optional

from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["ResumableLoader", "ResumableSampler"]


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that starts its next pass ``skip`` samples in, when the pass is of the
    epoch it was told (the resumed one)."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.resume: Optional[Dict[str, int]] = None  # {"epoch", "skip"}: where the next pass starts
        self.started_at = 0  # samples this pass skipped

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        self.started_at = 0
        if self.resume is not None and self.resume["epoch"] == self.epoch:
            self.started_at = min(self.resume["skip"], len(indices))
        self.resume = None
        return iter(indices[self.started_at :])


class ResumableLoader(DataLoader):
    """A shuffled training ``DataLoader`` (full batches only) with Lightning's ``state_dict`` /
    ``load_state_dict``.

    Args:
        dataset: the rows.
        batch_size: rows a batch.
        num_replicas: data-parallel replicas; each reads its own share.
        rank: this replica's index.
        seed: the shuffle's seed (with the epoch: the order).
        **kwargs: ``DataLoader``'s others (``num_workers``).
    """

    def __init__(
        self, dataset: Dataset, *, batch_size: int, num_replicas: int, rank: int, seed: int, **kwargs: Any
    ) -> None:
        sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, seed=seed)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)
        self.drawn = 0  # batches drawn this pass, counting those skipped on resume
        self.drawn_epoch: Optional[int] = None  # the epoch of that pass (None: no pass begun)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler) and self.batch_size is not None
        self.drawn = 0
        batches = super().__iter__()
        first = True
        for batch in batches:
            if first:  # the sampler's pass starts with the first batch: now its skip is known
                self.drawn, self.drawn_epoch = sampler.started_at // self.batch_size, sampler.epoch
                first = False
            self.drawn += 1
            yield batch

    def state_dict(self) -> Dict[str, int]:
        """Where the loader stands: the order (seed, epoch) and the batches of that epoch drawn.

        Between two passes the sampler already holds the next epoch (Lightning sets it when the epoch
        starts) while ``drawn`` still counts the last pass: that epoch has none drawn yet. A loaded
        state whose pass has not begun is still where it said."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler) and self.batch_size is not None
        if sampler.resume is not None and sampler.resume["epoch"] == sampler.epoch:
            batches = sampler.resume["skip"] // self.batch_size
        else:
            batches = self.drawn if self.drawn_epoch == sampler.epoch else 0
        return {"seed": sampler.seed, "epoch": sampler.epoch, "batches": batches}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Makes the next pass over ``state``'s epoch start after its drawn batches."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler) and self.batch_size is not None
        sampler.seed = state["seed"]
        sampler.set_epoch(state["epoch"])
        sampler.resume = {"epoch": state["epoch"], "skip": state["batches"] * self.batch_size}
