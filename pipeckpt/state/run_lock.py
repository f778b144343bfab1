"""One run at a time in a checkpoint directory: a run that starts while another writes there is refused.

Why: ``ModelCheckpoint`` versions its names (``last-v1.ckpt``) past the files it finds, which keeps
runs one after the other apart (:mod:`pipeckpt.state.final_checkpoint`), but two runs at once both
find no file, pick the same names and overwrite each other's checkpoints. Here global rank 0 holds
an advisory lock (``flock``) on a hidden file of each checkpoint directory while the run trains; the
kernel drops it when the process ends, however it ends, so a killed run never blocks the next. A
filesystem without locks (some network filesystems), or a system without ``flock``, is left
unguarded. A directory the run cannot write (read-only, another user's) is refused here too, on
every rank and before the first step: rank 0 alone meeting the ``OSError`` would leave the others
waiting at the broadcast, and the step's checkpoint would fail later anyway.
"""

import contextlib
import errno
import json
import logging
import os
import socket
import time
from typing import List, Optional, Tuple

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from pipeckpt._errors import config_error

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunLock"]

LOCK_NAME = ".pipeckpt-run.lock"

log = logging.getLogger(__name__)

_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _owner() -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%c")})


def _describe(text: str) -> str:
    try:
        owner = json.loads(text)
        return f"process {owner['pid']} on {owner['host']}, since {owner['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that holds its lock"


def _refuse(why: str, directory: str, detail: str) -> None:
    """Raises the refusal :meth:`RunLock._lock` found, on every rank."""
    if why == "unwritable":
        raise config_error(
            f"checkpoint directory {directory!r}",
            f"this run cannot write there ({detail}), so it could save no checkpoint",
            "give this run a writable checkpoint directory (ModelCheckpoint(dirpath=...), or a writable "
            "hydra.run.dir in train.py), or make this one writable",
        )
    raise config_error(
        f"checkpoint directory {directory!r}",
        f"another run is writing to it ({_describe(detail)}), and two runs at once would "
        "overwrite each other's checkpoints",
        "give this run a directory of its own (ModelCheckpoint(dirpath=...), or hydra.run.dir "
        "in train.py), or start it when the other run has ended",
    )


class RunLock:
    """The locks of one run on its checkpoint directories."""

    def __init__(self) -> None:
        self._held: List[Tuple[str, int]] = []

    def claim(self, trainer: Trainer) -> None:
        """Locks the directory of every ModelCheckpoint of ``trainer`` (on global rank 0), or raises
        on every rank, naming the run that holds one (a collective: every rank calls it)."""
        directories = sorted(
            {
                os.path.abspath(str(c.dirpath))
                for c in trainer.checkpoint_callbacks
                if isinstance(c, ModelCheckpoint) and c.dirpath
            }
        )
        taken: Optional[Tuple[str, str, str]] = None
        if trainer.is_global_zero:
            for directory in directories:
                taken = self._lock(directory)
                if taken is not None:
                    break
        taken = trainer.strategy.broadcast(taken, src=0)
        if taken is not None:
            self.release()
            _refuse(*taken)

    def _lock(self, directory: str) -> Optional[Tuple[str, str, str]]:
        """Takes the lock of ``directory``; (why not, directory, the holder or the system's words)
        when another run holds it or the directory cannot be written."""
        if fcntl is None:
            return None
        path = os.path.join(directory, LOCK_NAME)
        while True:
            try:
                os.makedirs(directory, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as error:  # read-only, no permission: said on every rank, not raised on one
                return "unwritable", directory, error.strerror or str(error)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                with os.fdopen(fd, "r") as held:
                    return "taken", directory, held.read()
            except OSError as error:
                os.close(fd)
                if error.errno in _NO_LOCKS:
                    log.info(
                        f"pipeckpt: {directory} cannot be locked ({error}); runs there are not kept apart"
                    )
                    return None
                raise
            # A run that ended removed the file it had locked: lock the one at the path now.
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, _owner().encode())
        self._held.append((path, fd))
        return None

    def release(self) -> None:
        """Removes and unlocks the lock files, in that order (a run waiting on one finds it gone)."""
        for path, fd in self._held:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)
        self._held = []
