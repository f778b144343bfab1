"""A filesystem that is full from a moment on, for the tests of a failed save: every file opened for
writing under one directory refuses its bytes with ENOSPC, as a full disk does. It works at
``open`` and ``io.open`` (under ``os.fdopen`` and ``Path.open``), so the code under test is not told
how it is being tested."""

import builtins
import errno
import io
import os
from pathlib import Path
from typing import Any, Callable

_REAL_OPEN = io.open


class _Full:
    """A file whose every write fails as on a full disk; everything else is the real file's."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> "_Full":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.close()


def _where(file: Any) -> str:
    if isinstance(file, int):  # os.fdopen: the path the descriptor is open on
        return os.readlink(f"/proc/self/fd/{file}")
    return os.path.abspath(os.fspath(file))


def fill(directory: Path) -> Callable[[], None]:
    """From now on, in this process, writes to files under ``directory`` fail with ENOSPC;
    returns the function that empties the disk again."""
    root = str(directory.resolve())

    def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        opened = _REAL_OPEN(file, mode, *args, **kwargs)
        if any(m in mode for m in "wax+") and _where(file).startswith(root + os.sep):
            return _Full(opened)
        return opened

    io.open = builtins.open = full_open  # type: ignore[assignment]

    def empty() -> None:
        io.open = builtins.open = _REAL_OPEN  # type: ignore[assignment]

    return empty
