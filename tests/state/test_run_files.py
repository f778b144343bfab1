"""A run writes only its own files (issue 37): two runs one after the other in one checkpoint
directory, under the local engine. The end-of-fit save and the SIGTERM save use the name Lightning's
ModelCheckpoint gave the run (``last-v1.ckpt`` when another run owns ``last.ckpt``), so each run's
final checkpoint holds its own final step and the other run's file is left as it was; a run that
starts while another trains there is refused. The distributed engine's runs are in
test_run_files_distributed.py, runs at once in separate processes in test_runs_at_once.py."""

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support.toy import ToyModule, fit

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.state.final_checkpoint import FinalCheckpoint
from pipeckpt.state.run_lock import LOCK_NAME

pytestmark = pytest.mark.usefixtures("one_thread")


def run(directory: Path, steps: int, *extra: L.Callback) -> ModelCheckpoint:
    """One run of ``steps`` steps that keeps ``last*.ckpt`` every 5 steps and at its end."""
    checkpoints = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=5)
    callbacks = [checkpoints, FinalCheckpoint(), *extra]
    fit(ToyModule(), "pipe", steps=steps, callbacks=callbacks, enable_checkpointing=True)
    return checkpoints


def step_of(path: Any) -> int:
    return int(torch.load(path, weights_only=True)["global_step"])


@pytest.fixture
def first_run(tmp_path) -> Path:
    """A first run's final checkpoint, ``last.ckpt`` at step 8, in ``tmp_path``."""
    run(tmp_path, 8)
    assert step_of(tmp_path / "last.ckpt") == 8
    return tmp_path


def test_a_second_run_ends_in_its_own_last_checkpoint_and_leaves_the_first_runs(first_run):
    second = run(first_run, 7)  # saved last-v1.ckpt at step 5, then its final step
    assert second.last_model_path == str(first_run / "last-v1.ckpt")
    assert step_of(first_run / "last-v1.ckpt") == 7
    assert step_of(first_run / "last.ckpt") == 8


def test_a_second_run_that_has_not_saved_yet_ends_in_a_new_version_not_in_the_first_runs_file(first_run):
    second = run(first_run, 3)  # its first save is the final one
    assert second.last_model_path == str(first_run / "last-v1.ckpt")
    assert step_of(first_run / "last-v1.ckpt") == 3
    assert step_of(first_run / "last.ckpt") == 8


class _SigtermAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_second_run_stopped_by_sigterm_saves_into_its_own_file(first_run):
    with pytest.raises(SystemExit) as stopped:
        run(first_run, 100, _SigtermAt(3))
    assert stopped.value.code == 143 and stopped.value.path == str(first_run / "last-v1.ckpt")
    assert step_of(first_run / "last-v1.ckpt") == 3
    assert step_of(first_run / "last.ckpt") == 8


class _SecondRunStarts(L.Callback):
    """Another run's FinalCheckpoint starting in the same directory while this run trains."""

    def __init__(self) -> None:
        self.refusal = ""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2 and not self.refusal:
            with pytest.raises(PipeckptConfigError) as refused:
                FinalCheckpoint().on_train_start(trainer, pl_module)
            self.refusal = str(refused.value)


def test_a_run_that_starts_while_another_trains_in_the_directory_is_refused_naming_both(tmp_path):
    second = _SecondRunStarts()
    run(tmp_path, 3, second)
    assert second.refusal.startswith(f"checkpoint directory {str(tmp_path)!r}: another run is writing to it")
    assert (
        f"process {os.getpid()}" in second.refusal
        and "HINT: give this run a directory of its own" in second.refusal
    )


def test_a_lock_file_left_by_a_killed_run_does_not_block_the_next_and_goes_with_it(tmp_path):
    (tmp_path / LOCK_NAME).write_text("left by a run killed with -9")
    run(tmp_path, 3)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
