"""A checkpoint directory put in place whole: a reader finds the old one or the new one, never a part.

Single files go through :func:`pipeckpt.state.files.atomic_write`; a directory is swapped here, in
one step where Linux allows it (``renameat2(RENAME_EXCHANGE)``), else moved aside first.
"""

import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path

from pipeckpt.state.files import fsync_dir, hidden_sibling_prefix

__all__ = ["exchange", "remove", "swap_into_place", "temporary_beside"]


def temporary_beside(target: Path) -> str:
    """A fresh name in ``target``'s directory (a rename from it never crosses filesystems), after
    removing what interrupted saves of ``target`` left there, if ``target`` itself is whole: then
    none of that is the only copy of a checkpoint."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(target):
        prefix = hidden_sibling_prefix(target.name)
        for pattern in (f"{prefix}sharded-*", f"{prefix}old-*"):
            for leftover in target.parent.glob(pattern):
                remove(leftover)
    return str(target.with_name(f"{hidden_sibling_prefix(target.name)}sharded-{uuid.uuid4().hex}"))


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swaps two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the libc or
    the filesystem cannot. Hand-written: ``os`` has no renameat2, and ctypes is less to trust than the
    one small PyPI wrapper of it."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def swap_into_place(tmp: Path, target: Path) -> None:
    """Puts the complete directory ``tmp`` at ``target``, then removes what was there.

    A new ``target``: one rename. An existing one: swapped in one step where the filesystem can (a
    reader finds the old checkpoint or the new one, whole); elsewhere moved aside first, so a reader
    finds the old one, nothing, or the new one, and never a part of one.
    """
    if not os.path.lexists(target):
        os.rename(tmp, target)
    elif exchange(tmp, target):
        fsync_dir(target.parent)
        remove(tmp)  # the old checkpoint, now under the temporary name
    else:
        aside = target.with_name(f"{hidden_sibling_prefix(target.name)}old-{uuid.uuid4().hex}")
        os.rename(target, aside)
        os.rename(tmp, target)
        fsync_dir(target.parent)
        remove(aside)
    fsync_dir(target.parent)
