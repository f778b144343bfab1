"""What a sharded checkpoint holds, read from its two small index files and no shard: every model
key with its shape, and the hyper-parameters of the model that wrote it.

Why: a resume under the distributed engine reads only the keys of this process's stages, so a
checkpoint of another model failed in :func:`pipeckpt.state.sharded.load` on the first key it lacked,
with no word of why. With the index, :func:`pipeckpt.state.fit.check_fits` names the differing keys
and hyper-parameters exactly as it does for the local engine's single files, before a byte of the
shards is read.
"""

import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pipeckpt.state import confined, safe_load
from pipeckpt.state.sharded import META_FILE

__all__ = ["model_index"]

_MODEL = "state_dict"  # the model's entries: DCP paths ("state_dict", key)


def model_index(
    path: "str | os.PathLike[str]", *, weights_only: Optional[bool] = None
) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """``({key: a meta tensor of the stored shape, or None for a non-tensor entry},
    hyper_parameters)`` of the sharded checkpoint at ``path`` (a directory that
    :func:`pipeckpt.state.sharded.is_sharded` accepts)."""
    root = Path(path)
    metadata = safe_load.SafeReader(root).read_metadata()  # refuses files outside root, reads none
    keys: Dict[str, Any] = {}
    for dcp_key, nested in metadata.planner_data.items():
        if not (isinstance(nested, tuple) and len(nested) == 2 and nested[0] == _MODEL):
            continue
        item = metadata.state_dict_metadata[dcp_key]
        keys[str(nested[1])] = (
            torch.empty(item.size, dtype=item.properties.dtype, device="meta")
            if isinstance(item, TensorStorageMetadata)
            else None
        )
    rest = confined.inside(root, META_FILE, "rank 0's part of the checkpoint")
    meta = safe_load.load_torch_file(rest, weights_only=weights_only)
    hparams = meta.get("hyper_parameters") if isinstance(meta, dict) else None
    return keys, hparams
