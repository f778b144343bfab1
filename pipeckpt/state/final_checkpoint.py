"""``last.ckpt`` holds the final step of a run, not the last validation's.

Why: ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` only when it saves anyway (after a
validation, every ``every_n_train_steps``), so a run of 53 steps validated every 50 ends with
``last.ckpt`` at step 50 and its last 3 steps in no checkpoint. This callback writes it once more
when training ends, if the final step is not in it yet, through the strategy (atomic, sharded
under the distributed engine). When ``max_steps`` ends the run, it is written at the end of that
step, unless a validation follows it (after which ModelCheckpoint saves it): by the end of training
Lightning has counted the epoch complete, so a checkpoint written then would resume at the next
epoch and skip the rest of this one. Under the name the ModelCheckpoint gave this run: ``last-v1.ckpt``
when another run's ``last.ckpt`` is in the directory, which this run must not overwrite; and a run
that starts while another trains in the same directory is refused (:mod:`pipeckpt.state.run_lock`).
"""

from typing import Any, List

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from pipeckpt._compat import last_checkpoint_path, saved_step, set_saved_step, validates_after_this_step
from pipeckpt.state.run_lock import RunLock

__all__ = ["FinalCheckpoint", "save_final"]


def save_final(trainer: Trainer) -> List[str]:
    """Writes every ``save_last`` ModelCheckpoint's last checkpoint that lacks the final step, under
    the name the callback gives this run (a collective under the distributed engine: every rank
    calls it); returns the paths written."""
    written = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.save_last or callback.dirpath is None:
            continue
        if saved_step(callback) == trainer.global_step and callback.last_model_path:
            continue
        path = last_checkpoint_path(callback, trainer)
        trainer.save_checkpoint(path, weights_only=False)  # the whole state, to resume from
        callback.last_model_path = path
        set_saved_step(callback, trainer.global_step)
        written.append(path)
    return written


class FinalCheckpoint(Callback):
    """Saves this run's last checkpoint at the end of training when the final step is not in it yet;
    holds its checkpoint directories meanwhile, refusing to start where another run trains."""

    def __init__(self) -> None:
        self._lock = RunLock()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._lock.claim(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        last_step = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        if last_step and not validates_after_this_step(trainer):
            save_final(trainer)  # the epoch still in progress, as the data's position is

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        save_final(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._lock.release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._lock.release()
