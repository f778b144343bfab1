"""``strategy.layout=auto`` in examples/slurm/pipe.sbatch across both nodes: srun starts every task,
each runs train.py itself, and the first task's search is the one every task trains
(pipeckpt/engines/distributed/startup.py ``from_rank_zero``)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from slurm_helpers import checkpoint_step, sbatch_wait
from workloads import PIPE

pytestmark = pytest.mark.slow

# The example job on a GPT searched for a preset cluster of 2 devices (its figures in conf/cluster/).
KEPT = tuple(a for a in PIPE.args if not a.startswith("model"))
AUTO = dataclasses.replace(PIPE, args=(*KEPT, "model=gpt", "strategy.layout=auto", "cluster=h100_8"))


def test_the_first_tasks_search_is_trained_by_every_task_across_two_nodes(slurm, tmp_path):
    steps = 2
    run_dir = tmp_path / "run"
    output = sbatch_wait(slurm, AUTO, run_dir, steps, tmp_path)
    assert output.count("layout search:") == 1, output  # rank 0's, alone
    said = re.findall(r"strategy\.layout=auto: training with (.+)", output)
    (row,) = [line.strip() for line in said if not line.endswith("(rank 0's search)")]  # rank 0's line
    assert f"strategy.layout=auto: training with {row} (rank 0's search)" in output, output
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == steps
