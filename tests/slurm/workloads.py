"""The training jobs the SLURM tests submit: pipeckpt's example job and a plain DDP canary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    script: str
    sbatch_options: tuple[str, ...]
    run_dir_arg: str  # the script's argument that sets the run dir, a format string
    steps_arg: str  # the script's argument that sets the number of steps, a format string
    args: tuple[str, ...]
    metrics: str  # the CSV file of the logger, relative to the run dir

    def sbatch_args(self, run_dir: Path, steps: int) -> list[str]:
        """sbatch's arguments: options, the script, then the script's arguments."""
        run = [self.run_dir_arg.format(run_dir), self.steps_arg.format(steps)]
        return [*self.sbatch_options, self.script, *run, *self.args]

    def last_checkpoint(self, run_dir: Path) -> Path:
        return max((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)


# examples/slurm/pipe.sbatch as a user would submit it, shrunk to 2 CPU nodes x 1 task and a tiny MLP:
# one pipeline stage per node, the distributed engine.
PIPE = Workload(
    script="examples/slurm/pipe.sbatch",
    sbatch_options=("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"),
    run_dir_arg="hydra.run.dir={}",
    steps_arg="trainer.max_steps={}",
    args=(
        "trainer.accelerator=cpu",
        "model=mlp",
        "model.lr=1e-2",
        "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=1000",
        "trainer.limit_val_batches=2",
        "trainer.enable_progress_bar=false",
        "validate=false",
        "~callbacks.stage_report",
        "+callbacks.faults._target_=faults.FaultInjection",  # tests/slurm is on PYTHONPATH
    ),
    metrics="logs/version_0/metrics.csv",
)

# tests/slurm/job.sbatch: the same cluster settings without pipeckpt.
DDP = Workload(
    script="tests/slurm/job.sbatch",
    sbatch_options=(),
    run_dir_arg="{}",
    steps_arg="--steps={}",
    args=("--strategy=ddp",),
    metrics="csv/version_0/metrics.csv",
)
