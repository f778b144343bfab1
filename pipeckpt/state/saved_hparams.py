"""The hyper-parameters a checkpoint was written with, read before anything is built.

Why: a resume that cannot fit (another model's checkpoint) is best refused before the model, the
data or the processes exist, and what tells is in Lightning's ``hyper_parameters`` entry, a few
bytes of a file that may hold gigabytes of tensors. Read here as the resume reads it (weights-only:
nothing a pickle names is run, :mod:`pipeckpt.state.safe_load`), without reading a tensor: a single
file is mapped, and of a sharded directory only rank 0's part
(:data:`~pipeckpt.state.sharded_index.META_FILE`) is opened.
"""

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from pipeckpt.state import confined, safe_load
from pipeckpt.state.sharded import require_sharded
from pipeckpt.state.sharded_index import META_FILE

__all__: List[str] = []

_ZIP = b"PK\x03\x04"  # torch.save's format since torch 1.6: the one torch.load can map


def saved_hyper_parameters(path: Union[str, "os.PathLike[str]"]) -> Optional[Dict[str, Any]]:
    """The ``hyper_parameters`` of the checkpoint at ``path`` (a file, or a sharded directory), or
    None where it saved none; a damaged file, or one holding anything but plain data, is refused
    naming it, as the resume would refuse it."""
    root = Path(path)
    if root.is_dir():
        file = confined.inside(require_sharded(root), META_FILE, "rank 0's part of the checkpoint")
        checkpoint = safe_load.load_torch_file(file)
    else:
        safe_load.check_torch_file(root)
        with open(root, "rb") as head:
            mapped = head.read(4) == _ZIP
        checkpoint = safe_load.load_torch_file(root, mmap=mapped)
    found = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    return dict(found) if isinstance(found, dict) else None
