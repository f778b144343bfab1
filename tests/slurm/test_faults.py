"""A rank that dies mid-run must make the others fail fast and name it, not hang.

Rank 1 calls os._exit(1) when step 2 starts (faults.py, switched on by environment variables);
the survivor must exit non-zero within 60 s of that, with an error that names rank 1. Once as an
ordinary `python script.py` launch (Lightning starts the second process), once under srun across
the two nodes of the test cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from slurm_helpers import HERE, PYTHON, ROOT, death_time, free_port, lost_rank_named

pytestmark = pytest.mark.slow

DEADLINE_S = 60  # from the death to the survivor's exit
STARTUP_S = 90  # importing torch and starting both ranks on a loaded 2-core machine
FAULT = {
    "PIPECKPT_TEST_DIE_RANK": "1",
    "PIPECKPT_TEST_DIE_STEP": "2",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
}


def _check(output: str, returncode: int | None, ended: float, survivor_prefix: str = "") -> None:
    died = death_time(output)
    assert returncode is not None, f"the survivor still ran {ended - died:.0f}s after rank 1 died:\n{output}"
    assert ended - died < DEADLINE_S, f"the survivor took {ended - died:.0f}s to exit:\n{output}"
    assert returncode != 0, output
    assert lost_rank_named(output, 1, survivor_prefix), (
        f"the survivor's error does not name rank 1:\n{output}"
    )


def test_dead_rank_on_this_machine(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # else Lightning picks SLURM
    env.update(FAULT, MASTER_ADDR="127.0.0.1")
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        # Its own session, so that a hanging run and the rank Lightning started can be killed together.
        proc = subprocess.Popen(
            [PYTHON, str(HERE / "job.py"), str(tmp_path / "run"), "--strategy=pipe"],
            env=env,
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode: int | None = proc.wait(timeout=STARTUP_S + DEADLINE_S)
        except subprocess.TimeoutExpired:
            returncode = None
        ended = time.time()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    _check(out.read_text(errors="replace"), returncode, ended)


def test_dead_rank_on_the_other_node(slurm, tmp_path: Path) -> None:
    # --kill-on-bad-exit=0: srun leaves the survivor alone (examples/slurm/pipe.sbatch sets 1),
    # so the survivor has to notice the loss itself.
    env = dict(slurm.env, **FAULT, MASTER_PORT=str(free_port()))
    cmd = [
        "srun",
        "-J",
        "fault",
        "-N2",
        "--ntasks-per-node=1",
        "--label",
        "--kill-on-bad-exit=0",
        PYTHON,
        str(HERE / "job.py"),
        str(tmp_path / "run"),
        "--strategy=pipe",
    ]
    try:
        result = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=STARTUP_S + DEADLINE_S
        )
        returncode: int | None = result.returncode
        output = result.stdout + result.stderr
    except subprocess.TimeoutExpired as e:  # the slurm fixture cancels the job
        returncode = None
        output = "".join(
            x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)
        )
    ended = time.time()
    (tmp_path / "out.txt").write_text(output)
    _check(output, returncode, ended, survivor_prefix="0: ")
