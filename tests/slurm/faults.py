"""Test-only hooks injected into training runs through environment variables.

Not part of pipeckpt: the SLURM and fault tests add this callback to a run (directly in
`job.py`, or to `train.py` with the Hydra override `+callbacks.faults._target_=faults.FaultInjection`
and `tests/slurm` on PYTHONPATH) so that the test, not the code under test, decides when a rank dies.

    PIPECKPT_TEST_DIE_RANK, PIPECKPT_TEST_DIE_STEP   that global rank calls os._exit(1) when that
                                                     global step starts (its peers then start the
                                                     step and wait on it), after printing
                                                     `faults: rank R dies at global_step=S time=T`
    PIPECKPT_TEST_STEP_SLEEP_S                       sleep this long in every training step
    PIPECKPT_TEST_PROGRESS_FILE                      rank 0 writes the global step there after each step

Every rank prints `faults: start rank=R global_step=S restart=N` when fitting starts, so a test can
read from the job's output where a requeued run resumed.
"""

from __future__ import annotations

import os
import sys
import time

from lightning.pytorch import Callback

__all__ = ["FaultInjection"]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


class FaultInjection(Callback):
    def __init__(self) -> None:
        self.die_rank = _env_int("PIPECKPT_TEST_DIE_RANK")
        self.die_step = _env_int("PIPECKPT_TEST_DIE_STEP")
        self.sleep_s = float(os.environ.get("PIPECKPT_TEST_STEP_SLEEP_S") or 0)
        self.progress_file = os.environ.get("PIPECKPT_TEST_PROGRESS_FILE") or None

    def on_train_start(self, trainer, pl_module) -> None:
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        print(
            f"faults: start rank={trainer.global_rank} global_step={trainer.global_step} restart={restart}",
            flush=True,
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Every rank of every engine runs this hook, unlike the backward hooks of a pipeline stage.
        if trainer.global_rank == self.die_rank and trainer.global_step == self.die_step:
            print(
                f"faults: rank {trainer.global_rank} dies at global_step={trainer.global_step}"
                f" time={time.time():.3f}",
                flush=True,
            )
            sys.stderr.flush()
            os._exit(1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.progress_file and trainer.global_rank == 0:
            tmp = f"{self.progress_file}.tmp"
            with open(tmp, "w") as f:
                f.write(str(trainer.global_step))
            os.replace(tmp, self.progress_file)
