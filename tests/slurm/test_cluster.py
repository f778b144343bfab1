"""The local cluster itself: two distinct nodes, and a plain Lightning DDP job across them.

If these fail, so will every other SLURM test, for reasons that have nothing to do with pipeckpt.
"""

from __future__ import annotations

import pytest
from slurm_helpers import assert_loss_fell, checkpoint_step, read_metric, sbatch_wait
from workloads import DDP

pytestmark = pytest.mark.slow


def test_tasks_run_on_two_named_nodes(slurm):
    out = slurm.run(
        "srun",
        "-J",
        "hosts",
        "-N2",
        "--ntasks-per-node=1",
        "--label",
        "sh",
        "-c",
        "echo $(hostname) $(getent hosts n1 | cut -d' ' -f1) $SLURM_NODEID",
    ).stdout
    assert sorted(out.splitlines()) == ["0: n1 127.0.0.1 0", "1: n2 127.0.0.1 1"], out


def test_lightning_ddp_job_across_two_nodes(slurm, tmp_path):
    steps = 12
    run_dir = tmp_path / "run"
    output = sbatch_wait(slurm, DDP, run_dir, steps, tmp_path)
    assert "All distributed processes registered. Starting with 2 processes" in output
    assert_loss_fell(read_metric(run_dir / DDP.metrics, "train_loss"))
    assert checkpoint_step(DDP.last_checkpoint(run_dir)) == steps
