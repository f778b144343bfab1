"""SIGUSR1 under SLURM at a quiet moment: hpc checkpoint at the next step boundary, requeue, resume.

The pipe strategy answers the signal with pipeckpt.state.preemption (tests/slurm/test_preemption_on_cluster.py
signals inside steps); the checkpoint name and the resume are Lightning's.
"""

from __future__ import annotations

import subprocess

import pytest
from slurm_helpers import ROOT, checkpoint_step, job_output, start_steps, wait_for
from workloads import PIPE

pytestmark = pytest.mark.slow


def test_sigusr1_saves_hpc_checkpoint_requeues_and_resumes(slurm, tmp_path):
    steps, signal_after = 24, 4
    progress = tmp_path / "progress"
    env = dict(slurm.env, PIPECKPT_TEST_STEP_SLEEP_S="0.25", PIPECKPT_TEST_PROGRESS_FILE=str(progress))
    out = tmp_path / "job.out"
    run_dir = tmp_path / "run"
    sbatch = subprocess.Popen(
        ["sbatch", "--wait", "--parsable", f"--output={out}", *PIPE.sbatch_args(run_dir, steps)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert sbatch.stdout is not None
        job = sbatch.stdout.readline().strip().split(";")[0]
        assert job.isdigit(), (
            f"sbatch printed no job id: {job!r} {sbatch.stderr.read() if sbatch.stderr else ''}"
        )

        def reached() -> bool:
            return progress.exists() and int(progress.read_text() or 0) >= signal_after

        wait_for(reached, 60, lambda: f"job {job} to reach step {signal_after}:\n{job_output(out)}")
        # Without --batch, the signal goes to the job's steps: the training processes, where
        # Lightning's handler listens (as with #SBATCH --signal=SIGUSR1@90).
        slurm.run("scancel", "--signal=USR1", job)
        returncode = sbatch.wait(timeout=100)
    finally:
        if sbatch.poll() is None:
            sbatch.kill()
            sbatch.wait()
    output = job_output(out)
    assert returncode == 0, output

    hpc = run_dir / "hpc_ckpt_1.ckpt"  # Lightning writes it in the Trainer's default_root_dir
    assert hpc.exists(), f"no {hpc}:\n{output}"
    saved = checkpoint_step(hpc)
    assert saved >= signal_after
    assert (
        f"pipeckpt: requeued SLURM job {job}" in output
    )  # pipeckpt.state.preemption, not Lightning's handler
    assert f"Restored all states from the checkpoint at {hpc}" in output
    starts = start_steps(output)
    assert sorted(starts) == [(0, 0, 0), (0, 1, 0), (1, 0, saved), (1, 1, saved)], output
    assert checkpoint_step(PIPE.last_checkpoint(run_dir)) == steps
