"""Checkpoint files that are the old complete file or the new one, never a half-written one.

Why not Lightning's ``TorchCheckpointIO``: its fsspec transaction writes a temporary in ``$TMPDIR`` and
commits by copying it onto the output filesystem, so a kill during that copy leaves a truncated
``last.ckpt``; it also holds the checkpoint twice in memory. Here ``torch.save`` streams into a
temporary file in the target's own directory, fsynced, renamed over the target, and the directory
fsynced; a directory is swapped in the same way (:func:`atomic_replace_dir`). A kill leaves at most a
hidden ``.pipeckpt-<digest>.<random>.tmp`` beside the target (docs/DESIGN.md, state/files).
"""

import contextlib
import hashlib
import os
import secrets
import shutil
from typing import Any, BinaryIO, Callable, Dict, Optional, Union

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from pipeckpt._errors import config_error
from pipeckpt.state.save_errors import checkpoint_bytes, named

__all__ = [
    "AtomicCheckpointIO",
    "atomic_replace_dir",
    "atomic_write",
    "fsync_dir",
    "fsync_tree",
    "hidden_sibling_prefix",
    "temporary_dir_beside",
]

PathLike = Union[str, "os.PathLike[str]"]  # str or pathlib.Path
_TMP_SUFFIX = ".tmp"


def hidden_sibling_prefix(name: str) -> str:
    """The prefix of the hidden siblings of a file or directory called ``name``. It holds a
    digest of the name, never the name: Lightning finds ``hpc_ckpt_N`` checkpoints by reading
    the digits of every file whose name contains ``ckpt_``, and a leftover
    ``.hpc_ckpt_2.ckpt.<random>.tmp`` would read as a far higher N."""
    return f".pipeckpt-{hashlib.sha1(name.encode()).hexdigest()[:12]}."


def _fresh_name(path: str, tag: str = "") -> str:
    """A hidden sibling of ``path`` that does not exist yet (callers create it with
    O_EXCL / mkdir, which fail rather than reuse a name)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f"{hidden_sibling_prefix(name)}{tag}{secrets.token_hex(6)}{_TMP_SUFFIX}")


def fsync_dir(directory: PathLike) -> None:
    """Makes a directory's entries (a rename, a new file) durable. POSIX only:
    Windows cannot open a directory for fsync, and its renames are journaled."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: PathLike, write: Callable[[BinaryIO], None], *, needed: Optional[int] = None) -> None:
    """Writes a file that appears under ``path`` only once complete.

    ``write`` receives a binary file open on a temporary file in ``path``'s
    directory (so the final rename never crosses filesystems); after it returns,
    the file is flushed and fsynced, renamed onto ``path`` with ``os.replace``,
    and the directory is fsynced. If ``write`` (or anything after it) raises, the
    temporary file is removed and ``path`` is left exactly as it was.

    Missing parent directories are created. Only local paths are supported. A filesystem that
    refuses the file (full, over quota, read-only, no permission) raises
    :class:`~pipeckpt._errors.PipeckptSaveError` naming it, ``path`` and ``needed`` (the bytes to
    write, if known), whatever ``write`` made of the ``OSError`` (torch's zip writer buries it).
    """
    try:
        _atomic_write(os.path.abspath(os.fspath(path)), write)
    except BaseException as error:
        refusal = named(error, path, needed=needed)
        if refusal is None or refusal is error:
            raise
        raise refusal from error


def _atomic_write(target: str, write: Callable[[BinaryIO], None]) -> None:
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    # Hand-written rather than tempfile.mkstemp: mkstemp creates the file with mode 0600,
    # while a checkpoint should get the same permissions (0666 minus umask) as a plain open().
    while True:
        tmp = _fresh_name(target)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:  # pragma: no cover - 48 random bits collided
            continue
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def temporary_dir_beside(path: PathLike) -> str:
    """Creates and returns an empty hidden directory next to ``path``, on the same
    filesystem, to write a directory checkpoint into before :func:`atomic_replace_dir`."""
    target = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    while True:
        tmp = _fresh_name(target)
        try:
            os.mkdir(tmp, 0o777)  # not tempfile.mkdtemp: it makes 0700, here the umask decides
            return tmp
        except FileExistsError:  # pragma: no cover - 48 random bits collided
            continue


def fsync_tree(root: PathLike) -> None:
    """fsyncs every file and directory under ``root``, so that after the rename the
    directory's content is as durable as its name."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)


def atomic_replace_dir(tmp_dir: PathLike, path: PathLike) -> None:
    """Moves a completely written directory ``tmp_dir`` to ``path``.

    ``tmp_dir``'s content is fsynced, then renamed onto ``path``. If ``path``
    already exists it is first renamed aside (to a hidden ``.pipeckpt-<digest>.old-*.tmp``
    sibling) and removed only after the new directory is in place, and the
    parent directory is fsynced in between. A kill between the two renames
    leaves no ``path`` but both complete versions under their hidden names;
    a kill at any other moment leaves ``path`` complete (old or new).

    ``tmp_dir`` must be on ``path``'s filesystem (see :func:`temporary_dir_beside`).
    """
    source = os.path.abspath(os.fspath(tmp_dir))
    target = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(target)
    if not os.path.isdir(source):
        raise config_error(
            f"tmp_dir={os.fspath(tmp_dir)!r}",
            "atomic_replace_dir moves a directory that has been written completely, and this is not one",
            "write the checkpoint into temporary_dir_beside(path) first, then pass that directory",
        )
    if os.stat(source).st_dev != os.stat(parent).st_dev:
        raise config_error(
            f"tmp_dir={os.fspath(tmp_dir)!r}",
            f"it is on another filesystem than {os.fspath(path)!r}, so it cannot be renamed in one step",
            "create it with temporary_dir_beside(path), which puts it next to the target",
        )
    fsync_tree(source)
    aside: Optional[str] = None
    if os.path.lexists(target):
        aside = _fresh_name(target, tag="old-")
        os.rename(target, aside)
    try:
        os.rename(source, target)
    except BaseException:
        if aside is not None:
            os.rename(aside, target)  # put the old version back under its name
        raise
    fsync_dir(parent)
    if aside is not None:
        if os.path.isdir(aside) and not os.path.islink(aside):
            shutil.rmtree(aside)
        else:
            os.unlink(aside)


def _local_path(path: PathLike) -> Optional[str]:
    """The filesystem path of a local path or ``file://`` URL; None for anything else."""
    fs, stripped = url_to_fs(str(path))
    return stripped if isinstance(fs, LocalFileSystem) else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """A ``TorchCheckpointIO`` whose local saves are atomic and durable.

    ``save_checkpoint`` streams ``torch.save`` into a temporary file next to the
    target (no in-memory copy of the serialised checkpoint), fsyncs it, renames
    it onto the target and fsyncs the directory (:func:`atomic_write`). Paths may
    be ``str``, ``pathlib.Path`` or ``file://`` URLs.

    Non-local fsspec URLs (``s3://``, ``gs://``, ...) fall back to Lightning's
    behaviour (``TorchCheckpointIO``): an object store has no rename, and its
    uploads are already all-or-nothing. Loading and removing are Lightning's
    (removing takes a directory checkpoint too).

    Use: ``Trainer(..., plugins=[AtomicCheckpointIO()])``.
    """

    @override
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], path: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        local = _local_path(path) if storage_options is None else None
        if local is None:  # remote storage, or storage_options (which the parent refuses clearly)
            super().save_checkpoint(checkpoint, str(path), storage_options=storage_options)
            return
        atomic_write(local, lambda file: torch.save(checkpoint, file), needed=checkpoint_bytes(checkpoint))
