"""`python train.py -m hydra/launcher=slurm ...` submits each run as a SLURM job and waits for it."""

from __future__ import annotations

import importlib.util
import pickle

import pytest
from slurm_helpers import PYTHON, checkpoint_step, unavailable

pytestmark = pytest.mark.slow


def test_multirun_through_submitit_runs_on_both_nodes(slurm, tmp_path):
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        unavailable("hydra-submitit-launcher is not installed: pip install -e .[slurm]")
    sweep = tmp_path / "multirun"
    steps = 6
    result = slurm.run(
        PYTHON,
        "train.py",
        "-m",
        "hydra/launcher=slurm",
        f"hydra.sweep.dir={sweep}",
        "strategy.engine=distributed",
        "trainer.num_nodes=2",
        "trainer.devices=1",
        "trainer.accelerator=cpu",
        "model=mlp",
        f"trainer.max_steps={steps}",
        "trainer.enable_progress_bar=false",
        "validate=false",
        "~callbacks.stage_report",
        timeout=110,
        check=False,
    )
    # sacct needs slurmdbd, which the test cluster lacks: submitit warns and falls back on its result files.
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    (folder,) = (p for p in (sweep / ".submitit").iterdir() if p.is_dir() and not p.is_symlink())
    job = folder.name
    script = (folder / f"{job}_submission.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --job-name=pipeckpt" in script, script
    for task in (0, 1):  # one task per node, each with its own result
        with open(folder / f"{job}_{task}_result.pkl", "rb") as f:
            outcome, _ = pickle.load(f)
        log = (folder / f"{job}_{task}_log.err").read_text(errors="replace")
        assert outcome == "success", log
    assert checkpoint_step(sweep / "0" / "checkpoints" / "last.ckpt") == steps
