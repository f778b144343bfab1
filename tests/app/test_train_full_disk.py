"""train.py on a full disk: a checkpoint the filesystem refuses ends the run with exit 1 and
pipeckpt's one message (no space, the path, the fix), no traceback. The disk is a real 256 KiB
tmpfs holding only the checkpoints, so the test needs root (CI runs as root) and skips without it."""

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from test_train_e2e import train


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = (
        os.geteuid() == 0
        and (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True
            )
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("mounting a 256 KiB tmpfs needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_checkpoint_that_fills_the_disk_ends_train_py_with_its_message_and_no_traceback(
    tmp_path, small_disk
):
    done = train(tmp_path / "run", f"callbacks.model_checkpoint.dirpath={small_disk}", check=False)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Checkpoint not saved:" in done.stderr and "no space left on device" in done.stderr, done.stderr[
        -3000:
    ]
    assert str(small_disk) in done.stderr and "HINT" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
