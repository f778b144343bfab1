"""Out of space, named (issue 37, item 3), under the local engine: a save that the filesystem refuses
(here a disk that fills up during a real fit, ENOSPC injected at the file's writes) raises an error
saying what happened, with the path, the bytes being written and the fix; the previous checkpoint
stays whole and a new run resumes from it. The distributed engine's are in
test_full_disk_distributed.py, the messages' pieces in test_save_errors.py."""

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support import full_disk
from support.toy import ToyModule, fit

pytestmark = pytest.mark.usefixtures("one_thread")


class _FillsUpAfter(L.Callback):
    """The disk under ``directory`` is full once step ``step`` is done."""

    def __init__(self, directory: Path, step: int) -> None:
        self.directory, self.step, self.empty = directory, step, None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and self.empty is None:
            self.empty = full_disk.fill(self.directory)


def run(directory: Path, steps: int, *extra: L.Callback, ckpt_path: Any = None) -> L.Trainer:
    checkpoints = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=2)
    callbacks = [checkpoints, *extra]
    return fit(
        ToyModule(), "pipe", steps=steps, callbacks=callbacks, enable_checkpointing=True, ckpt_path=ckpt_path
    )


@pytest.fixture
def failed(tmp_path) -> Any:
    """A run whose disk fills up after step 3: the save of step 4 fails."""
    full = _FillsUpAfter(tmp_path, 3)
    try:
        with pytest.raises(OSError) as raised:
            run(tmp_path, 8, full)
    finally:
        if full.empty is not None:
            full.empty()
    return tmp_path, raised.value


def test_a_save_onto_a_full_disk_says_no_space_with_the_path_bytes_and_fix(failed):
    directory, error = failed
    message = str(error)
    assert "no space left on device" in message, message
    assert repr(str(directory / "epoch=0-step=4.ckpt")) in message, message
    assert "bytes" in message and "HINT: free space on that filesystem" in message, message
    assert "unexpected pos" not in message


def test_after_a_full_disk_the_previous_checkpoint_resumes(failed):
    directory, _ = failed
    assert int(torch.load(directory / "last.ckpt", weights_only=True)["global_step"]) == 2
    assert sorted(p.name for p in directory.iterdir()) == [
        "epoch=0-step=2.ckpt",
        "last.ckpt",
    ]  # no partial file
    resumed = run(directory / "resumed", 4, ckpt_path=directory / "last.ckpt")
    assert resumed.global_step == 4
