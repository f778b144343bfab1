"""A checkpoint directory's files are read only from inside that directory.

Why: DCP's ``.metadata`` names each tensor's file as a path relative to the checkpoint, and its
reader joins that path to the directory as given: an absolute path, a ``..`` or a shard that is a
symbolic link reaches any file the process can read. A checkpoint is a file a user was handed, so
a crafted one could plant weights from elsewhere, or read and probe for files outside it. Every
file a load opens is resolved here first, symbolic links followed, and refused unless it lies
inside the directory, before any byte of it (or of any other shard) is read.
"""

import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Tuple, Union

from pipeckpt._compat import dcp_files
from pipeckpt._errors import PipeckptCheckpointError, checkpoint_error

__all__ = ["escape", "inside", "require_inside", "storage_files"]

PathLike = Union[str, "os.PathLike[str]"]
_HINT = (
    "a checkpoint reads only files inside its own directory: this one was altered, or copied with "
    "links to files elsewhere; resume from a checkpoint you trust, or copy the whole directory with "
    "its links followed (`cp -rL`, `rsync -aL`) if you trust its source"
)


def escape(root: PathLike, name: str, within: Union[PathLike, None] = None) -> Union[str, None]:
    """How ``name`` (relative to ``root``) leaves ``within`` (``root`` itself when None: a Hub
    snapshot's files link into its repository folder, which holds it), or None when it stays inside."""
    if os.path.isabs(name):
        return "is an absolute path (the files are named relative to the directory)"
    real_root = os.path.realpath(root)
    boundary = os.path.realpath(within) if within is not None else real_root
    target = os.path.realpath(Path(root) / name)
    if os.path.commonpath([boundary, target]) == boundary and target != boundary:
        return None
    if os.path.normpath(os.path.join(real_root, name)) != target:
        return f"is a symbolic link (or lies under one) that leads to {target!r}, outside the directory"
    return f"leads to {target!r}, outside the directory"


def inside(root: PathLike, name: str, what: str) -> Path:
    """``root / name``, checked to lie inside ``root`` once symbolic links are followed; ``what``
    says which entry of the checkpoint names it (for the refusal)."""
    base = Path(root)
    how = escape(base, name)
    if how is not None:
        raise _outside(base, [(what, name, how)])
    return base / name


def require_inside(root: PathLike, entries: Iterable[Tuple[str, str]]) -> None:
    """Refuses ``root`` if any ``(what, name)`` entry names a file outside it, listing the first few."""
    base = Path(root)
    bad: List[Tuple[str, str, str]] = []
    for what, name in entries:
        how = escape(base, name)
        if how is not None:
            bad.append((what, name, how))
    if bad:
        raise _outside(base, bad)


def storage_files(root: PathLike, metadata: Any, key_of: Callable[[str], str]) -> List[Tuple[str, str]]:
    """Every file DCP's ``metadata`` names, once each, as ``(what, name)``: ``what`` names the first
    entry stored in it, by the key ``key_of(fqn)`` gives (the module's own key where known). An
    entry that names no file path is refused here."""
    seen: Dict[str, str] = {}
    for fqn, name in dcp_files(metadata).items():
        what = f"the storage entry of {key_of(fqn)!r}"
        if not isinstance(name, str) or not name:
            raise checkpoint_error(
                f"checkpoint directory {str(root)!r}",
                f"{what} names no file ({name!r}) in DCP's index, so the index was altered",
                _HINT,
            )
        seen.setdefault(name, what)
    return [(what, name) for name, what in seen.items()]


def _outside(root: Path, bad: List[Tuple[str, str, str]]) -> PipeckptCheckpointError:
    listed = "; ".join(f"{what} names the file {name!r}, which {how}" for what, name, how in bad[:3])
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    return checkpoint_error(
        f"checkpoint directory {str(root)!r}",
        f"{listed}{more}; nothing was read from it",
        _HINT,
    )
