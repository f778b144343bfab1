"""examples/slurm/pipe.sbatch across both nodes: a two-stage pipeline, one stage per node."""

from __future__ import annotations

import pytest
from slurm_helpers import assert_loss_fell, checkpoint_step, job_output, read_metric, start_steps
from workloads import PIPE

pytestmark = pytest.mark.slow


def test_pipe_sbatch_trains_across_two_nodes(slurm, tmp_path):
    steps = 20
    run_dir = tmp_path / "run"
    result = slurm.run("sbatch", "--wait", f"--output={tmp_path}/job.out", *PIPE.sbatch_args(run_dir, steps),
                       timeout=110, check=False)
    output = job_output(tmp_path / "job.out")
    assert result.returncode == 0, f"{result.stderr}\n{output}"
    assert "All distributed processes registered. Starting with 2 processes" in output
    assert sorted(start_steps(output)) == [(0, 0, 0), (0, 1, 0)], output
    assert_loss_fell(read_metric(run_dir / PIPE.metrics, "train_loss"))
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == steps
