"""A run's checkpoint as a source of model tensors, read a few keys at a time.

Why: an export must never hold the whole model. A sharded directory (the distributed engine's, any
layout) is read through :func:`pipeckpt.state.sharded.load` with ``keys=``, which reads only those
tensors' bytes; a single ``.ckpt`` file (the local engine's) is opened memory-mapped, so a tensor is
read from disk when its bytes are used and the optimizer state is never touched. Both stay confined to
the checkpoint (:mod:`pipeckpt.state.confined`, :mod:`pipeckpt.state.safe_load`).
"""

import os
from pathlib import Path
from typing import Any, Collection, Dict, Optional, Union

import torch

from pipeckpt._errors import config_error
from pipeckpt.state import safe_load, sharded
from pipeckpt.state.sharded_index import ShardedIndex, read_index

__all__ = ["CheckpointSource"]

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointSource:
    """The model entries of the Lightning checkpoint at ``path``: a sharded directory or one file."""

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self._file: Dict[str, Any] = {}
        self._index: Optional[ShardedIndex] = None  # a sharded directory's, read once
        #: What the LightningModule recorded (``save_hyperparameters``): the app's model=hf names
        #: its pretrained directory there (:func:`pipeckpt.export.origin.recorded`).
        self.hyper_parameters: Any = None
        if self.path.is_dir():
            self._index = read_index(sharded.require_sharded(self.path), weights_only=True)
            stored, self.hyper_parameters = self._index.model()
            self.shapes = {k: v for k, v in stored.items() if isinstance(v, torch.Tensor)}
        elif self.path.is_file():
            checkpoint = safe_load.load_torch_file(self.path, weights_only=True, mmap=True)
            state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
            if not isinstance(state, dict):
                raise config_error(
                    f"checkpoint file {str(self.path)!r}",
                    "holds no 'state_dict' (it is not a Lightning checkpoint)",
                    "export a checkpoint written by Trainer.fit or trainer.save_checkpoint",
                )
            self._file = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            self.hyper_parameters = checkpoint.get("hyper_parameters")
            self.shapes = {k: v.to("meta") for k, v in self._file.items()}
        else:
            raise config_error(
                f"checkpoint path {str(path)!r}",
                "is neither a sharded checkpoint directory nor a checkpoint file",
                "pass a .ckpt file of the local engine or a directory of the distributed engine",
            )

    def read(self, keys: Collection[str]) -> Dict[str, torch.Tensor]:
        """The tensors stored under ``keys``, on the CPU; only their bytes are read. From a file,
        the memory-mapped tensors themselves: their pages are the file's (page cache the kernel may
        drop), so an export writing them holds none of them (benchmarks/RESULTS_export.md)."""
        if not self._file:
            return dict(
                sharded.load(self.path, keys=keys, weights_only=True, index=self._index)["state_dict"]
            )
        return {key: self._file[key] for key in keys}
