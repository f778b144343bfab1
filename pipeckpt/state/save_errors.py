"""A checkpoint the filesystem refused, named: no space, over quota, read-only, no permission.

Why: ``torch.save`` reports a failed write as its zip writer's ``enforce fail ... unexpected pos``,
keeping the ``OSError`` only in the chain, and DCP hands a rank's failure to the others pickled, chain
dropped, raised from inside a collective (which the distributed engine reads as a peer's timeout).
Here the filesystem's error is found in the chain and told as what it is: the path, the bytes being
written, the fix, and that the previous checkpoint is intact (saves are atomic: state/files).
"""

import errno
import os
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from pipeckpt._errors import PipeckptSaveError, save_error
from pipeckpt.sizes import human

__all__ = [
    "REFUSALS",
    "NamingWriter",
    "checkpoint_bytes",
    "filesystem_fixes",
    "named",
    "not_written",
    "refused",
    "storage_error",
]

REFUSALS: Dict[int, str] = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
"""The errors of a filesystem that will not take the checkpoint, as pipeckpt names them."""

_ELSEWHERE = "point ModelCheckpoint(dirpath=...) (or the Trainer's default_root_dir) elsewhere"


def filesystem_fixes(elsewhere: str, space: str = "") -> Dict[int, str]:
    """The fix of each error of :data:`REFUSALS`, ending in ``elsewhere`` (where else to write);
    ``space``: what the writer needs, said beside the fix for a full filesystem."""
    return {
        errno.ENOSPC: f"free space on that filesystem{space} or {elsewhere}",
        errno.EDQUOT: f"free space within your quota there, ask for a larger quota, or {elsewhere}",
        errno.EROFS: f"mount that filesystem writable or {elsewhere}",
        errno.EACCES: f"give this user write access to that directory or {elsewhere}",
        errno.EPERM: f"give this user write access to that directory or {elsewhere}",
    }


_FIXES = filesystem_fixes(_ELSEWHERE)


def storage_error(error: Optional[BaseException]) -> Optional[OSError]:
    """The filesystem's refusal (an errno of :data:`REFUSALS`) in ``error``'s chain, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in REFUSALS:
            return error
        error = error.__cause__ or error.__context__
    return None


def checkpoint_bytes(checkpoint: Any) -> int:
    """The bytes of the tensors in ``checkpoint`` (each storage once): about what a save writes."""
    storages: Dict[Any, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if isinstance(value, DTensor):  # a wrapper without storage: this rank writes its shard
                value = value.to_local()
            if not value.is_meta:
                storage = value.untyped_storage()
                storages[(storage.device, storage.data_ptr())] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(checkpoint)
    return sum(storages.values())


def refused(
    path: "os.PathLike[str] | str", cause: OSError, *, needed: Optional[int], who: str = ""
) -> PipeckptSaveError:
    """The error to raise for a save of ``path`` that the filesystem refused with ``cause``:
    ``needed`` bytes being written (None: unknown), by ``who`` (``"rank 1"``: a rank's part)."""
    code = int(cause.errno or errno.EIO)
    target = os.fspath(path)
    by = f"{who} " if who else ""
    writing = (
        f" ({by}writing at least {human(needed)}: {needed} bytes of tensors)"
        if needed
        else (f" ({who})" if who else "")
    )
    where = (
        f" at {os.fspath(cause.filename)!r}" if cause.filename and os.fspath(cause.filename) != target else ""
    )
    intact = (
        f"the previous checkpoint {target!r} is intact"
        if os.path.lexists(target)
        else f"the checkpoints already in {os.path.dirname(os.path.abspath(target))!r} are intact"
    )
    return save_error(
        code,
        f"checkpoint {target!r}",
        f"{REFUSALS.get(code, os.strerror(code))}{writing}{where}, so it was not saved",
        f"{_FIXES.get(code, _ELSEWHERE)}; {intact}",
    )


def named(
    error: BaseException, path: "os.PathLike[str] | str", *, needed: Optional[int] = None, who: str = ""
) -> Optional[PipeckptSaveError]:
    """``error`` as pipeckpt names it, when it is (or was caused by) the filesystem's refusal to
    take the checkpoint at ``path``; None for any other error."""
    if isinstance(error, PipeckptSaveError):
        return error  # named already, closer to the failure
    cause = storage_error(error)
    return None if cause is None else refused(path, cause, needed=needed, who=who)


class NamingWriter(dcp.FileSystemWriter):
    """DCP's file writer, raising a refused write as the filesystem's own ``OSError``: DCP pickles a
    rank's failure to hand it to the others, which drops the chain where torch's zip writer keeps it."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except BaseException as error:
            cause = storage_error(error)
            if cause is None or cause is error:
                raise
            raise cause from None

    def finish(self, metadata: Any, results: Any) -> None:
        try:
            super().finish(metadata, results)
        except BaseException as error:
            cause = storage_error(error)
            if cause is None or cause is error:
                raise
            raise cause from None


def not_written(
    target: "os.PathLike[str] | str", failures: Mapping[int, Any], sizes: List[int], detail: str
) -> BaseException:
    """What every rank raises when DCP's save failed on the ranks of ``failures`` (rank -> its
    error, or DCP's (error, traceback) pair): the first refusal of the filesystem named, with the
    bytes that rank was writing (``sizes``, by rank), else DCP's ``detail`` of the failure."""
    for rank in sorted(failures):
        failure = failures[rank]
        error = failure[0] if isinstance(failure, tuple) else failure
        cause = storage_error(error) if isinstance(error, BaseException) else None
        if cause is not None:
            needed = sizes[rank] if rank < len(sizes) else None
            return refused(target, cause, needed=needed, who=f"rank {rank}")
    return RuntimeError(f"the sharded checkpoint {os.fspath(target)!r} was not written: {detail}")
