"""SIGTERM at a random moment of a train.py run: a checkpoint saved at the next step boundary
(loadable, holding the step it names) and a non-zero exit, in three trials, under the local engine
and under the distributed engine (two processes; the signal reaches rank 0 only)."""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeckpt.state import sharded

ROOT = Path(__file__).resolve().parents[2]
RUN = ["model=mlp", "model.hidden=16", "model.depth=2", "validate=false", "trainer.max_steps=100000"]
RUN += ["trainer.val_check_interval=20", "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false"]
RUN += ["threads=1"]


DISTRIBUTED = ["strategy.engine=distributed", "trainer.devices=2", "trainer.accelerator=cpu"]


def trial(out: Path, delay_s: float, *extra: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PL_"))}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "train.py", *RUN, *extra, f"hydra.run.dir={out}"]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 240
        while not list((out / "checkpoints").glob("epoch=*.ckpt")):  # training is under way
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, output[-3000:]
    saved = re.findall(
        r"rank (\d+) terminated by SIGTERM: saved (\S+) at global_step=(\d+); exiting with 143", output
    )
    world = 2 if extra else 1
    assert sorted(int(rank) for rank, _, _ in saved) == list(range(world)), output[-3000:]
    assert len({(path, step) for _, path, step in saved}) == 1, output[-3000:]  # one step, one checkpoint
    path, step = Path(saved[0][1]), int(saved[0][2])
    assert path == out / "checkpoints" / "last.ckpt"
    checkpoint = sharded.load(path) if extra else torch.load(path, weights_only=True)
    assert checkpoint["global_step"] == step >= 20
    # The loop's progress names the same step: the step's batch is started but not yet completed (it
    # may be an epoch's first batch, when a signal lands while the epoch's loader starts up).
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["total"]["ready"] == step == progress["total"]["completed"] + 1
    assert progress["current"]["ready"] == progress["current"]["completed"] + 1 >= 1


@pytest.mark.parametrize("trial_number", range(3))
def test_sigterm_saves_at_a_step_boundary_and_exits_non_zero(tmp_path, trial_number):
    delay = random.Random().uniform(0.0, 1.5)
    print(f"SIGTERM {delay:.3f} s after the first checkpoint")
    trial(tmp_path, delay)


@pytest.mark.slow
@pytest.mark.parametrize("trial_number", range(2))
def test_sigterm_to_rank_zero_saves_every_ranks_part_at_one_step_and_exits_non_zero(tmp_path, trial_number):
    delay = random.Random().uniform(0.0, 1.5)
    print(f"SIGTERM {delay:.3f} s after the first checkpoint")
    trial(tmp_path, delay, *DISTRIBUTED)
