"""What a train.py run leaves and reports at its end: ``last.ckpt`` holds the final step, and after
a requeue (a SLURM job resumed from its hpc checkpoint) the printed ``val_loss at end`` is that of
the final weights and the step count covers this run only."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from support import forkserver

from pipeckpt.app.data import SyntheticVectors
from pipeckpt.app.models import MLP

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(in_features=8, hidden=16, depth=2, num_classes=4)
SMALL = ["model=mlp", *[f"model.{k}={v}" for k, v in MODEL.items()], "data.num_samples=256"]
SMALL += ["data.val_samples=64", "trainer.enable_progress_bar=false", "threads=1"]
SLURM = dict(
    SLURM_JOB_ID="4242", SLURM_JOB_NAME="train-end", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
    SLURM_NNODES="1", SLURM_NODELIST="localhost", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
)  # fmt: skip


def train(out: Path, *overrides: str, slurm: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PL_"))}
    env.update(PYTHONPATH=str(ROOT), **(SLURM if slurm else {}))
    command = [sys.executable, "train.py", *SMALL, f"hydra.run.dir={out}", *overrides]
    done = forkserver.run(command, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def step_of(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["global_step"])


def test_last_ckpt_holds_the_final_step(tmp_path):
    train(tmp_path, "trainer.max_steps=53", "validate=false")  # validated and saved at step 50
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 53


def test_a_run_saves_its_whole_state_without_lightnings_weights_only_note(tmp_path):
    # Saving with weights_only unset makes Lightning print "`weights_only` was not set, defaulting to
    # `False`", which reads as a warning about unpickling; the run says what it saves instead.
    done = train(tmp_path, "trainer.max_steps=3", "validate=false")
    assert "weights_only" not in done.stdout + done.stderr
    assert "optimizer_states" in torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)


def test_a_requeued_run_reports_its_final_weights_and_its_own_steps(tmp_path):
    train(tmp_path / "first", "trainer.max_steps=8", "trainer.val_check_interval=4", "validate=false")
    requeued = tmp_path / "requeued"
    requeued.mkdir()
    # A requeued job: Lightning resumes from the newest hpc checkpoint in the run's root directory.
    shutil.copy(tmp_path / "first" / "checkpoints" / "last.ckpt", requeued / "hpc_ckpt_1.ckpt")
    done = train(requeued, "trainer.max_steps=13", "trainer.val_check_interval=4", slurm=True)
    end = next(line for line in done.stdout.splitlines() if line.startswith("val_loss at end"))
    last = requeued / "checkpoints" / "last.ckpt"
    assert step_of(last) == 13
    module = MLP(**MODEL)
    module.load_state_dict(torch.load(last, weights_only=True)["state_dict"])
    data = SyntheticVectors(
        in_features=8, num_classes=4, num_samples=256, val_samples=64, batch_size=32, seed=0
    )
    fresh = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, limit_val_batches=20)
    expected = fresh.validate(module, data, verbose=False)[0]["val_loss"]
    assert abs(float(end.split()[-1]) - expected) < 6e-5, done.stdout[-2000:]
    summary = done.stdout.splitlines()[-1]
    assert "5 steps (from step 8 to 13) in" in summary, summary
