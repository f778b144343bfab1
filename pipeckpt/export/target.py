"""Where an export may write, and what it says when the filesystem will not take it.

Why: an export replaces its directory whole (written beside it, then renamed onto it), so the
directory it replaces must hold nothing but an earlier export. Telling an export's files by their
names was not enough: a pretrained directory without tokenizer files holds only names an export
writes (config.json, model-*.safetensors), and an export onto it replaced the very shards the run
started from. So an export leaves a record of the files it wrote (:data:`RECORD`), and replaces only
an empty directory or one whose record lists every file in it, and never the pretrained directory
it reads. A read-only or full filesystem is named with the target and the fix, not raised as a bare
``OSError``; what the failed export had written beside the target is removed by its caller.
"""

import errno
import json
import os
import uuid
from pathlib import Path
from typing import List, Optional

from pipeckpt._errors import PipeckptSaveError, config_error, save_error
from pipeckpt.state.files import hidden_sibling_prefix
from pipeckpt.state.save_errors import REFUSALS, filesystem_fixes, storage_error

__all__ = ["RECORD", "check_target", "probe_writable", "refusal", "write_record"]

RECORD = ".pipeckpt-export.json"
"""The files an export wrote, listed in its directory: what a later export may replace."""

_ELSEWHERE = "pass another out"
_FIXES = filesystem_fixes(_ELSEWHERE, space=" (an export needs about the model's size)")


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _recorded_files(target: Path) -> List[str]:
    """The files an earlier export recorded writing into ``target`` (none without a record)."""
    try:
        record = json.loads((target / RECORD).read_text())
    except (OSError, ValueError):
        return []
    files = record.get("files") if isinstance(record, dict) else None
    return [name for name in files if isinstance(name, str)] if isinstance(files, list) else []


def check_target(target: Path, *, origin: Optional[Path], setting: str = "out") -> None:
    """Refuses an ``out`` (``setting`` names it as the user gave it) that is the pretrained
    directory ``origin`` the export reads, or that holds anything an earlier export did not write:
    the export replaces it whole. Reads only; an absent or empty directory is welcome."""
    if not os.path.lexists(target):
        return
    if origin is not None and _same(target, origin):
        raise config_error(
            f"{setting}={str(target)!r}",
            "is the pretrained directory the export reads its config and tokenizer from, and an "
            "export replaces its directory whole",
            "export into a new directory",
        )
    if target.is_dir() and not target.is_symlink():
        written = set(_recorded_files(target)) | {RECORD}
        others = sorted(p.name for p in target.iterdir() if p.name not in written)
    else:
        others = [target.name]
    if others:
        raise config_error(
            f"{setting}={str(target)!r}",
            f"holds {others[:5]}, which no export wrote (an export replaces its directory whole, "
            f"and only a directory an earlier export wrote, as its {RECORD} lists)",
            "export into a new directory, or into an earlier export's",
        )


def write_record(tmp: Path) -> None:
    """Lists the files of the finished export ``tmp`` in its :data:`RECORD`."""
    files = sorted(p.name for p in tmp.iterdir())
    (tmp / RECORD).write_text(json.dumps({"written_by": "pipeckpt.export", "files": files}, indent=2) + "\n")


def refusal(target: Path, error: BaseException, *, setting: str = "out") -> Optional[PipeckptSaveError]:
    """``error`` named, when it is (or was caused by) the filesystem's refusal to take the export
    at ``target`` (read-only, full, over quota, no permission); None for any other error."""
    if isinstance(error, PipeckptSaveError):
        return error
    cause = storage_error(error)
    if cause is None:
        return None
    code = int(cause.errno or errno.EIO)
    where = f" at {os.fspath(cause.filename)!r}" if cause.filename else ""
    return save_error(
        code,
        f"{setting}={str(target)!r}",
        f"{REFUSALS.get(code, os.strerror(code))}{where}, so nothing was exported and nothing "
        "partial is left",
        _FIXES.get(code, _ELSEWHERE),
    )


def probe_writable(target: Path, *, setting: str = "out") -> None:
    """Refuses a ``target`` whose directory cannot be written (read-only, no permission) before
    any work: makes and removes an empty hidden directory beside it."""
    probe = target.with_name(f"{hidden_sibling_prefix(target.name)}probe-{uuid.uuid4().hex}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        named = refusal(target, error, setting=setting)
        if named is None:
            raise
        raise named from None
