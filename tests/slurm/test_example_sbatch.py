"""examples/slurm/pipe.sbatch across both nodes: a two-stage pipeline, one stage per node."""

from __future__ import annotations

import pytest
from slurm_helpers import assert_loss_fell, checkpoint_step, read_metric, sbatch_wait, start_steps
from workloads import PIPE

pytestmark = pytest.mark.slow


def test_pipe_sbatch_trains_across_two_nodes(slurm, tmp_path):
    steps = 20
    run_dir = tmp_path / "run"
    output = sbatch_wait(slurm, PIPE, run_dir, steps, tmp_path)
    assert "All distributed processes registered. Starting with 2 processes" in output
    assert sorted(start_steps(output)) == [(0, 0, 0), (0, 1, 0)], output
    assert_loss_fell(read_metric(run_dir / PIPE.metrics, "train_loss"))
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == steps
