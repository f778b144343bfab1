"""Seeded synthetic data for tests and quick runs, one DataModule per input kind.

Each task is learnable (a small model's loss falls within a few dozen steps),
so an end-to-end test can check that training trains, not only that it runs.
The same ``seed`` always gives the same tensors, on any machine.
"""

from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["SyntheticTokens", "SyntheticVectors", "SyntheticImages"]


class _Synthetic(L.LightningDataModule):
    """Builds a train and a validation TensorDataset from ``_make``.

    The task itself (the "teacher") is drawn from ``seed``; the train and
    validation samples from ``seed + 1`` and ``seed + 2``, so validation holds
    new samples of the same task.
    """

    def __init__(self, *, num_samples: int, val_samples: int, batch_size: int, seed: int) -> None:
        super().__init__()
        for name, value in (("num_samples", num_samples), ("val_samples", val_samples)):
            if value < batch_size:
                raise ValueError(
                    f"{name} must hold at least one batch ({name}: {value}, batch_size: {batch_size}); "
                    f"raise {name} or lower batch_size"
                )
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.batch_size = batch_size
        self.seed = seed
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def _make(
        self, task: torch.Generator, samples: torch.Generator, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        self.train_set = TensorDataset(*self._make(self._gen(0), self._gen(1), self.num_samples))
        self.val_set = TensorDataset(*self._make(self._gen(0), self._gen(2), self.val_samples))

    def _gen(self, offset: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + offset)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() runs before the dataloaders"
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "setup() runs before the dataloaders"
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)


class SyntheticTokens(_Synthetic):
    """Arithmetic sequences modulo ``vocab_size``: ``x[t] = (a + s * t) % vocab``.

    Start ``a`` and step ``s`` (one of ``steps``) vary per sequence; after two
    tokens the rest is determined, so the loss can fall far below ln(vocab).
    """

    def __init__(
        self,
        *,
        seq_len: int = 64,
        vocab_size: int = 256,
        steps: int = 8,
        num_samples: int = 512,
        val_samples: int = 64,
        batch_size: int = 16,
        seed: int = 0,
    ) -> None:
        super().__init__(num_samples=num_samples, val_samples=val_samples, batch_size=batch_size, seed=seed)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.steps = steps

    def _make(
        self, task: torch.Generator, samples: torch.Generator, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(self.vocab_size, (n, 1), generator=samples)
        step = torch.randint(1, self.steps + 1, (n, 1), generator=samples)
        seq = (start + step * torch.arange(self.seq_len + 1)) % self.vocab_size
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class SyntheticVectors(_Synthetic):
    """Gaussian vectors labelled by a random linear teacher: ``y = argmax(W x)``."""

    def __init__(
        self,
        *,
        in_features: int = 32,
        num_classes: int = 10,
        num_samples: int = 1024,
        val_samples: int = 256,
        batch_size: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__(num_samples=num_samples, val_samples=val_samples, batch_size=batch_size, seed=seed)
        self.in_features = in_features
        self.num_classes = num_classes

    def _make(
        self, task: torch.Generator, samples: torch.Generator, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        teacher = torch.randn(self.num_classes, self.in_features, generator=task)
        x = torch.randn(n, self.in_features, generator=samples)
        return x, (x @ teacher.T).argmax(dim=1)


class SyntheticImages(_Synthetic):
    """Noisy copies of one random prototype image per class."""

    def __init__(
        self,
        *,
        in_channels: int = 3,
        image_size: int = 16,
        num_classes: int = 10,
        noise: float = 1.0,
        num_samples: int = 512,
        val_samples: int = 128,
        batch_size: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__(num_samples=num_samples, val_samples=val_samples, batch_size=batch_size, seed=seed)
        self.shape = (in_channels, image_size, image_size)
        self.num_classes = num_classes
        self.noise = noise

    def _make(
        self, task: torch.Generator, samples: torch.Generator, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prototypes = torch.randn(self.num_classes, *self.shape, generator=task)
        labels = torch.randint(self.num_classes, (n,), generator=samples)
        images = prototypes[labels] + self.noise * torch.randn(n, *self.shape, generator=samples)
        return images, labels
