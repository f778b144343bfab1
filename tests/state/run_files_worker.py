"""One rank of a distributed run of issue 37's file tests, started by test_run_files_distributed.py
and test_full_disk_distributed.py (see tests/support/ranks.py).

Each run of the spec trains the toy module in two stages under ``engine`` (default "distributed")
for ``steps`` steps into the checkpoint directory ``dir`` (ModelCheckpoint every ``every`` steps,
``save_last``, and pipeckpt's FinalCheckpoint), from ``resume`` if given. ``full``: {"rank": r,
"after": s}: the disk under ``dir`` is full for rank r once step s is done. ``hold``: {"after": s,
"ready": path, "until": path}: once step s is done every rank creates ``ready`` and waits for
``until`` to exist (a run kept training while another starts). A run that ends writes
``<out>/<name>.rank<R>.json`` (the run's last checkpoint and final step); one that raises prints
its error last and exits non-zero.
"""

import json
import os
import time
from pathlib import Path
from typing import Any, Dict

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from support import full_disk
from support.ranks import quiet_trainer, serve
from support.toy import ToyModule, toy_loader

from pipeckpt import PipelineStrategy
from pipeckpt.state.final_checkpoint import FinalCheckpoint

HOLD_S = 120  # the longest a held run waits


class FillsUpAfter(L.Callback):
    def __init__(self, directory: str, rank: int, step: int) -> None:
        self.directory, self.rank, self.step = Path(directory), rank, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            full_disk.fill(self.directory)  # this process ends with the run


class Holds(L.Callback):
    def __init__(self, step: int, ready: str, until: str) -> None:
        self.step, self.ready, self.until = step, Path(ready), Path(until)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.ready.touch()
            deadline = time.monotonic() + HOLD_S
            while not self.until.exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    checkpoints = ModelCheckpoint(dirpath=spec["dir"], save_last=True, every_n_train_steps=spec["every"])
    callbacks = [checkpoints, FinalCheckpoint()]
    if "full" in spec:
        callbacks.append(FillsUpAfter(spec["dir"], spec["full"]["rank"], spec["full"]["after"]))
    if "hold" in spec:
        callbacks.append(Holds(spec["hold"]["after"], spec["hold"]["ready"], spec["hold"]["until"]))
    engine = spec.get("engine", "distributed")
    timeout = {"timeout": HOLD_S + 60} if engine == "distributed" else {}
    strategy = PipelineStrategy(engine=engine, balance=[3, 3], chunks=2, **timeout)
    trainer = quiet_trainer(
        strategy, world, max_steps=spec["steps"], enable_checkpointing=True, callbacks=callbacks
    )
    trainer.fit(ToyModule(), toy_loader(), ckpt_path=spec.get("resume"))
    rank = trainer.global_rank
    result = {"last": checkpoints.last_model_path, "step": trainer.global_step}
    with open(os.path.join(out, f"{spec['name']}.rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    serve(run)
