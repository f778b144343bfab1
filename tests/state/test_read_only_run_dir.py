"""A checkpoint directory the run cannot write (issue 45): the run lock, the first thing a run writes
there, refuses it before the first step with a :class:`~pipeckpt.PipeckptConfigError` naming the
directory and the fix, not the system's bare ``OSError``. As root, file modes block no write, so
the filesystem's refusal is simulated where the lock creates its file."""

import errno
import os
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from support.toy import ToyModule, fit

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.state.final_checkpoint import FinalCheckpoint


def _refusing(monkeypatch, directory: Path, code: int) -> None:
    """Makes ``directory`` refuse new files with ``code``, as a read-only or foreign directory does."""
    real = os.open

    def open_(path, flags, *args, **kwargs):
        if Path(path).parent == directory and flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES], ids=["read-only", "no-permission"])
def test_a_checkpoint_directory_the_run_cannot_write_is_refused_naming_it_and_the_fix(
    tmp_path, monkeypatch, code
):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    _refusing(monkeypatch, directory, code)
    checkpoints = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=1)
    with pytest.raises(PipeckptConfigError) as refused:
        fit(
            ToyModule(),
            "pipe",
            steps=2,
            callbacks=[checkpoints, FinalCheckpoint()],
            enable_checkpointing=True,
        )
    message = str(refused.value)
    assert message.startswith(f"checkpoint directory {str(directory)!r}: this run cannot write there"), (
        message
    )
    assert os.strerror(code) in message
    assert "HINT: give this run a writable checkpoint directory" in message
    assert os.listdir(directory) == []  # refused before any step wrote a checkpoint
