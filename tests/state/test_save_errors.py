"""A save the filesystem refuses is named (pipeckpt/state/save_errors.py): full, over quota,
read-only or forbidden, each with its fix, the path, and the previous checkpoint left whole; for a
single file (atomic_write) and for a sharded directory written by one process. Real fits under both
engines are in test_full_disk.py and test_full_disk_distributed.py."""

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from support import full_disk

from pipeckpt._errors import PipeckptSaveError
from pipeckpt.state import sharded
from pipeckpt.state.files import AtomicCheckpointIO, atomic_write

REFUSED = {
    errno.ENOSPC: ("no space left on device", "free space on that filesystem"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota"),
    errno.EROFS: ("read-only file system", "mount that filesystem writable"),
    errno.EACCES: ("permission denied", "give this user write access"),
}


@pytest.mark.parametrize("code", list(REFUSED), ids=errno.errorcode.get)
def test_each_refusal_of_the_filesystem_is_named_with_its_fix_and_the_intact_previous_file(
    tmp_path, monkeypatch, code
):
    path = tmp_path / "last.ckpt"
    atomic_write(path, lambda file: file.write(b"previous"))
    real_fsync = os.fsync

    def refuse(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", refuse)
    with pytest.raises(PipeckptSaveError) as raised:
        atomic_write(path, lambda file: file.write(b"new"), needed=3)
    monkeypatch.setattr(os, "fsync", real_fsync)
    what, fix = REFUSED[code]
    assert raised.value.errno == code
    assert str(raised.value).startswith(
        f"checkpoint {str(path)!r}: {what} (writing at least 3 B: 3 bytes of tensors)"
    )
    assert f"HINT: {fix}" in str(raised.value)
    assert f"the previous checkpoint {str(path)!r} is intact" in str(raised.value)
    assert path.read_bytes() == b"previous"


def test_a_full_disk_under_torch_save_is_named_not_torchs_unexpected_pos(tmp_path):
    empty = full_disk.fill(tmp_path)
    try:
        with pytest.raises(PipeckptSaveError, match="no space left on device") as raised:
            AtomicCheckpointIO().save_checkpoint({"w": torch.ones(1000)}, tmp_path / "a.ckpt")
    finally:
        empty()
    assert "(writing at least 3.9 KiB: 4000 bytes of tensors)" in str(raised.value)
    assert os.listdir(tmp_path) == []


def test_other_failures_of_a_write_go_on_as_raised(tmp_path):
    def fails(file: Any) -> None:
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(OSError) as raised:
        atomic_write(tmp_path / "a.ckpt", fails)
    assert type(raised.value) is OSError and raised.value.errno == errno.EIO


def _sharded(value: float) -> dict:
    return {"state_dict": {"w": torch.full((64,), value)}, "global_step": int(value)}


def test_a_sharded_save_onto_a_full_disk_names_it_and_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    sharded.save(_sharded(1.0), path)
    empty = full_disk.fill(tmp_path)
    try:
        with pytest.raises(PipeckptSaveError) as raised:
            sharded.save(_sharded(2.0), path)
    finally:
        empty()
    message = str(raised.value)
    assert message.startswith(f"checkpoint {str(path)!r}: no space left on device (rank 0 writing "), message
    assert f"the previous checkpoint {str(path)!r} is intact" in message
    assert sharded.load(path)["global_step"] == 1
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["last.ckpt"]
