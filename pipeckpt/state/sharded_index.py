"""A sharded checkpoint's two small files, read once: DCP's index of the shards and rank 0's part.

Why an object: three readers want them before or instead of the shards. A resume under the
distributed engine checks the index against the module (:func:`pipeckpt.state.fit.check_fits`
names a checkpoint of another model by its differing keys and hyper-parameters, before a byte of
the shards is read), then reads this process's keys; an export reads the weights group by group.
Each read the two files anew (an export, once per group of weights it read), and DCP's reader
read the index once more; one :class:`ShardedIndex` serves them all.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pipeckpt.state import confined, safe_load

__all__ = ["META_FILE", "DCP_METADATA", "ShardedIndex", "read_index"]

META_FILE = "pipeckpt-meta.pt"
"""Rank 0's part of the checkpoint: every entry but the tensors' (a ``torch.save`` file)."""

DCP_METADATA = ".metadata"  # the file DCP's FileSystemWriter commits last

_MODEL = "state_dict"  # the model's entries: DCP paths ("state_dict", key)


@dataclass(frozen=True)
class ShardedIndex:
    """What a sharded checkpoint directory holds, read from its index files and no shard."""

    root: Path
    metadata: Metadata
    """DCP's index, its every storage file checked to lie inside ``root``."""
    rest: Dict[str, Any]
    """Rank 0's part: loops, callbacks, RNG, hyper-parameters, optimizers' groups. Read, not owned:
    :func:`pipeckpt.state.sharded.load` copies what it changes."""

    def model(self) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        """``({key: a meta tensor of the stored shape, or None for a non-tensor entry},
        hyper_parameters)``."""
        keys: Dict[str, Any] = {}
        for dcp_key, nested in self.metadata.planner_data.items():
            if not (isinstance(nested, tuple) and len(nested) == 2 and nested[0] == _MODEL):
                continue
            item = self.metadata.state_dict_metadata[dcp_key]
            keys[str(nested[1])] = (
                torch.empty(item.size, dtype=item.properties.dtype, device="meta")
                if isinstance(item, TensorStorageMetadata)
                else None
            )
        hparams = self.rest.get("hyper_parameters") if isinstance(self.rest, dict) else None
        return keys, hparams


def read_index(path: "str | os.PathLike[str]", *, weights_only: Optional[bool] = None) -> ShardedIndex:
    """The index of the sharded checkpoint at ``path`` (a directory that
    :func:`pipeckpt.state.sharded.require_sharded` accepts); ``weights_only`` is passed to
    ``torch.load`` for rank 0's part, as Lightning does."""
    root = Path(path)
    metadata = safe_load.SafeReader(root).read_metadata()  # refuses files outside root, reads none
    rest = confined.inside(root, META_FILE, "rank 0's part of the checkpoint")
    return ShardedIndex(root, metadata, safe_load.load_torch_file(rest, weights_only=weights_only))
