"""Every reach into torch.distributed.checkpoint's private names: the classes inside a DCP
checkpoint's ``.metadata`` and the function that rebuilds a layout by name, which a loader that
admits exactly these classes must name (pipeckpt/state's confined loading of sharded checkpoints).

Each entry says why no public API serves; ``tests/test_compat.py`` checks each by name and
behaviour.
"""

from typing import Any, Dict

# DCP's ``.metadata`` is a plain pickle of its Metadata dataclass, and two of the classes inside
# it (the per-item file extent, the memory-format enum) and the function that rebuilds a layout
# are private; a loader that admits exactly these classes must name them.
from torch.distributed.checkpoint.filesystem import _StorageInfo as DcpStorageInfo
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as DcpMemoryFormat
from torch.serialization import _get_layout as layout_by_name

__all__ = ["DcpMemoryFormat", "DcpStorageInfo", "dcp_file_extents", "dcp_files", "layout_by_name"]


def dcp_files(metadata: Any) -> Dict[str, Any]:
    """The file each item of a DCP checkpoint is stored in (its path relative to the checkpoint
    directory), by DCP's flat key; None for an entry that is not DCP's private ``_StorageInfo``
    (only a crafted ``.metadata`` holds one)."""
    return {
        index.fqn: info.relative_path if isinstance(info, DcpStorageInfo) else None
        for index, info in metadata.storage_data.items()
    }


def dcp_file_extents(metadata: Any, keys: Any) -> Dict[str, int]:
    """The bytes each shard file of a DCP checkpoint must hold at least (the furthest end of the
    items of DCP's flat ``keys``), by file name relative to the checkpoint directory:
    ``Metadata.storage_data`` maps every item to a private ``_StorageInfo`` (file, offset, length)."""
    extents: Dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn not in keys:
            continue
        end = int(info.offset) + int(info.length)
        extents[info.relative_path] = max(end, extents.get(info.relative_path, 0))
    return extents
