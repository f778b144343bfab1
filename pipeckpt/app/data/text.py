"""Byte-level language-modelling data from local files.

Every machine with Python has a few megabytes of real text on disk: the
standard library's own ``.py`` sources. Using it as the default corpus makes
``python train.py`` work offline, with no download, and still give a loss that
visibly falls. Any other directory or file can be used through ``path``.

Tokens are bytes (vocabulary 256), so there is no tokenizer to install or to
keep consistent between training and evaluation.
"""

import fnmatch
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from pipeckpt._errors import config_error

__all__ = ["TextDataModule", "check_validation", "read_corpus"]

#: Directories of the standard library that hold installed packages, not the library.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _files(root: Path, pattern: str) -> Iterator[Path]:
    """Files under ``root`` matching ``pattern``, depth-first in name order.

    A fixed order makes the corpus, and so the train/validation split, the
    same on every machine. The walk is lazy and prunes installed packages, so
    reading the first megabytes of a large tree costs milliseconds.
    """
    if root.is_file():
        yield root
        return
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in _SKIP_DIRS)
        for name in sorted(names):
            if fnmatch.fnmatch(name, pattern):
                yield Path(folder, name)


def read_corpus(path: Optional[str], *, pattern: str = "*.py", max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of the concatenated files under ``path``
    (the standard library's sources when ``path`` is None)."""
    root = Path(path if path is not None else sysconfig.get_paths()["stdlib"]).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"text corpus path {str(root)!r} does not exist; set data.path to a file or a "
            f"directory of text files, or leave it null for the Python standard library"
        )
    chunks, size = [], 0
    for file in _files(root, pattern):
        data = file.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if not corpus:
        raise FileNotFoundError(
            f"no text found under {str(root)!r} matching {pattern!r} (empty files count as none); "
            f"point data.path at a non-empty file or directory, or change data.pattern"
        )
    return corpus


def check_validation(windows: Dataset, batch_size: int) -> None:
    """Refuses a validation split of fewer windows than one batch, naming the settings that grow it."""
    if len(windows) < batch_size:  # type: ignore[arg-type]
        raise config_error(
            f"data.batch_size={batch_size}",
            f"the validation split holds {len(windows)} windows, fewer than one batch",  # type: ignore[arg-type]
            "raise data.max_bytes or data.val_fraction, or lower data.batch_size",
        )


class Windows(Dataset):
    """Windows of ``seq_len + 1`` bytes, as (input, target) shifted by one.

    ``stride=1`` makes every offset a sample (shuffled, these are random
    windows); ``stride=seq_len`` tiles the text without overlap.
    """

    def __init__(self, data: torch.Tensor, *, seq_len: int, stride: int) -> None:
        if len(data) < seq_len + 1:
            raise config_error(
                f"data.seq_len={seq_len} on a text of {len(data)} tokens",
                f"one window takes seq_len + 1 = {seq_len + 1} tokens",
                "use a bigger corpus (data.max_bytes, data.val_fraction) or a smaller seq_len",
            )
        self.data = data
        self.seq_len = seq_len
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.data) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class TextDataModule(L.LightningDataModule):
    """Byte-level windows for next-token prediction.

    The validation set is the contiguous tail of the corpus (``val_fraction``
    of it), so no training window overlaps a validation byte. Training draws
    windows at random offsets; validation tiles its part without overlap, in
    order, so that ``val_loss`` is comparable between runs.
    """

    def __init__(
        self,
        *,
        path: Optional[str] = None,
        pattern: str = "*.py",
        seq_len: int = 128,
        batch_size: int = 16,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"val_fraction must lie strictly between 0 and 1 (val_fraction: {val_fraction}); "
                f"e.g. 0.05 holds out the last 5% of the corpus"
            )
        self.save_hyperparameters()
        # Typed copies of the settings: hparams is an untyped mapping.
        self.path = path
        self.pattern = pattern
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.train_set: Optional[Windows] = None
        self.val_set: Optional[Windows] = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        corpus = read_corpus(self.path, pattern=self.pattern, max_bytes=self.max_bytes)
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        cut = len(data) - int(len(data) * self.val_fraction)
        self.train_set = Windows(data[:cut], seq_len=self.seq_len, stride=1)
        self.val_set = Windows(data[cut:], seq_len=self.seq_len, stride=self.seq_len)
        check_validation(self.val_set, self.batch_size)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() runs before the dataloaders"
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,  # a pipeline needs batch >= chunks; a short last batch could break that
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "setup() runs before the dataloaders"
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
        )
