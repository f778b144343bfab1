"""SIGUSR1 at any moment of a step, on the real two-node cluster: every trial saves the same step on
every rank, requeues, resumes from it, and the run ends bitwise equal to an uninterrupted one.

One job per engine is requeued once per trial (8 trials in all, each moment at least once per
engine): the distributed engine on 2 nodes x 1 task, the local engine (2 stages in one process) on 1
node. Each trial's moment (forward, backward, optimizer step, ModelCheckpoint's save), its rank (0,
1 or every rank) and how many steps after the resume it comes are drawn from a fixed seed; one trial
per job is delivered by `scancel --signal=USR1` (to every task, a moment later) instead of by the
rank to itself. The uninterrupted references run at the same time as ordinary processes (no SLURM)
with the same layout.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from slurm_helpers import HERE, PYTHON, ROOT, checkpoint_step, free_port, job_output

pytestmark = pytest.mark.slow

SEED = 11
PHASES = ("forward", "backward", "optimizer", "checkpoint")
# A hang detector, not a speed check: 9-11 runs of 2 ranks, each importing torch and Lightning afresh,
# measured 140-215 s beside the rest of the suite on 2 cores.
JOB_TIMEOUT_S = 420


@dataclass(frozen=True)
class Trial:
    restart: int
    rank: str  # "0", "1" or "all"
    offset: int  # steps after the resume
    phase: str
    delivery: str  # "self" or "scancel"

    def entry(self) -> str:
        return f"{self.restart}:{self.rank}:{self.offset}:{self.phase}:{self.delivery}"


@dataclass(frozen=True)
class Setup:
    engine: str
    nodes: int
    ranks: tuple[str, ...]
    trials: int
    steps: int


DISTRIBUTED = Setup(engine="distributed", nodes=2, ranks=("0", "1", "all"), trials=4, steps=60)
LOCAL = Setup(engine="local", nodes=1, ranks=("0",), trials=4, steps=40)


def draw(setup: Setup, rng: random.Random) -> list[Trial]:
    """Every phase at least once, one trial delivered by scancel, the rest by the rank itself."""
    phases = list(PHASES) + [rng.choice(PHASES) for _ in range(setup.trials - len(PHASES))]
    rng.shuffle(phases)
    by_scancel = rng.randrange(setup.trials)
    return [
        Trial(
            restart=i,
            rank=rng.choice(setup.ranks),
            offset=rng.randint(1, 4),
            phase=phase,
            delivery="scancel" if i == by_scancel else "self",
        )
        for i, phase in enumerate(phases)
    ]


def submit(slurm, setup: Setup, trials: list[Trial], run_dir: Path) -> subprocess.Popen[str]:
    env = dict(slurm.env, PIPECKPT_TEST_PREEMPT=",".join(t.entry() for t in trials))
    run_dir.mkdir(parents=True)  # sbatch writes the output file, not its folder
    return subprocess.Popen(
        [
            "sbatch",
            "--wait",
            f"--output={run_dir}/job.out",
            f"--nodes={setup.nodes}",
            "--ntasks-per-node=1",
            str(HERE / "preempt_job.sbatch"),
            str(run_dir),
            f"--engine={setup.engine}",
            f"--steps={setup.steps}",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def reference(setup: Setup, run_dir: Path) -> subprocess.Popen[bytes]:
    """The uninterrupted run, without SLURM (Lightning starts the second process itself)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1"
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(HERE), env.get("PYTHONPATH")) if p)
    run_dir.mkdir(parents=True)
    with open(run_dir / "out.txt", "w") as sink:
        return subprocess.Popen(
            [
                PYTHON,
                str(HERE / "preempt_job.py"),
                str(run_dir),
                f"--engine={setup.engine}",
                f"--steps={setup.steps}",
            ],
            env=env,
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # with the rank it starts, killed together if it hangs
        )


def finish(proc: subprocess.Popen, timeout: float, *, group: bool) -> int | None:
    """Its exit code, or None after killing it (with its session when `group`) at the timeout."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()  # sbatch --wait; the slurm fixture cancels the job itself
        except ProcessLookupError:
            pass
        proc.wait()
        return None


def saved_steps(output: str, ranks: int) -> list[tuple[int, Path]]:
    """Per trial: the step every rank saved and the hpc checkpoint, after checking that they agree."""
    found: dict[int, list[tuple[int, Path]]] = {r: [] for r in range(ranks)}
    for rank, path, step in re.findall(
        r"pipeckpt: rank (\d+) preempted: saved (\S+) at global_step=(\d+)", output
    ):
        found[int(rank)].append((int(step), Path(path)))
    assert all(found[r] == found[0] for r in found), f"the ranks saved different steps: {found}\n{output}"
    return found[0]


def starts(output: str) -> list[tuple[int, int, int]]:
    """(restart, rank, global_step) of every run's start."""
    found = re.findall(r"preempt: start rank=(\d+) global_step=(\d+) restart=(\d+)", output)
    return sorted((int(restart), int(rank), int(step)) for rank, step, restart in found)


def check(setup: Setup, trials: list[Trial], run_dir: Path, ref_dir: Path, returncode: int | None) -> None:
    output = job_output(run_dir / "job.out")
    assert returncode == 0, f"the job did not end well ({returncode}):\n{output}"
    ranks = setup.nodes
    saved = saved_steps(output, ranks)
    assert len(saved) == len(trials), f"{len(saved)} preemptions for {len(trials)} trials:\n{output}"
    assert output.count("pipeckpt: requeued SLURM job") == len(trials), output

    resumed_at = [0] + [step for step, _ in saved]
    assert starts(output) == [(i, r, resumed_at[i]) for i in range(len(trials) + 1) for r in range(ranks)], (
        output
    )
    for i, (trial, (step, path)) in enumerate(zip(trials, saved)):
        assert path == run_dir / f"hpc_ckpt_{i + 1}.ckpt", (trial, path)
        assert checkpoint_step(path) == step, (trial, path)
        signalled = resumed_at[i] + trial.offset
        if trial.delivery == "self":
            # The boundary after the signalled step; ModelCheckpoint's save comes after that check.
            assert step == signalled + (2 if trial.phase == "checkpoint" else 1), (trial, step, output)
        else:
            assert step > signalled, (trial, step, output)

    for r in range(ranks):
        got = torch.load(run_dir / "final" / f"rank{r}.pt")
        want = torch.load(ref_dir / "final" / f"rank{r}.pt")
        assert got.keys() == want.keys() and got, (r, got.keys(), want.keys())
        different = [k for k in got if not torch.equal(got[k], want[k])]
        assert different == [], f"rank {r}: {different} differ from the uninterrupted run"


def test_sigusr1_anywhere_in_a_step_resumes_bitwise_equal(slurm, tmp_path):
    rng = random.Random(SEED)
    setups = [DISTRIBUTED, LOCAL]
    plans = {s.engine: draw(s, rng) for s in setups}
    assert sum(len(p) for p in plans.values()) >= 8
    refs = {s.engine: reference(s, tmp_path / f"ref-{s.engine}") for s in setups}
    jobs = {s.engine: submit(slurm, s, plans[s.engine], tmp_path / s.engine) for s in setups}
    try:
        codes = {engine: finish(job, JOB_TIMEOUT_S, group=False) for engine, job in jobs.items()}
        ref_codes = {engine: finish(ref, 60, group=True) for engine, ref in refs.items()}
    finally:
        for proc in jobs.values():
            finish(proc, 0, group=False)
        for proc in refs.values():
            finish(proc, 0, group=True)
    for s in setups:
        ref_out = (tmp_path / f"ref-{s.engine}" / "out.txt").read_text(errors="replace")
        assert ref_codes[s.engine] == 0, f"the uninterrupted {s.engine} run failed:\n{ref_out}"
        check(s, plans[s.engine], tmp_path / s.engine, tmp_path / f"ref-{s.engine}", codes[s.engine])
