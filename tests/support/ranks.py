"""Real worker processes for the multi-process tests: one per rank, gloo on CPU.

Each test file names its worker script and hands it a JSON spec of runs; every process runs in
a session of its own, so a test can always kill a rank and everything it started. Ranks are forked
from a server that has done the imports once (:mod:`support.forkserver`; ``PIPECKPT_TEST_FORK=0``
starts fresh interpreters)."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Sequence, Union

import pytest

from support import forkserver, trainers
from support.paths import REPO, launcher_free, worker_pythonpath

# A rank process: forked by the server, or a fresh interpreter.
Rank = Union[subprocess.Popen, forkserver.Forked]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(worker: Path, world: int, runs: List[Dict[str, Any]], out: Path) -> List[Rank]:
    """Starts ``world`` ranks of ``worker`` on ``runs``; each writes ``out/rank<r>.log``."""
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    env = rank_env(world)
    procs: List[Rank] = []
    for rank in range(world):
        log = out / f"rank{rank}.log"
        procs.append(spawn(worker, [str(spec)], dict(env, LOCAL_RANK=str(rank)), rank, REPO, log))
    return procs


def rank_env(world: int) -> Dict[str, str]:
    """The environment of one group of ``world`` ranks on this machine (a fresh port), outside any
    launcher's (SLURM, torchrun, Lightning); each rank adds its ``LOCAL_RANK``."""
    env = launcher_free(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=worker_pythonpath(),
    )
    return env


def spawn(worker: Path, args: List[str], env: Dict[str, str], rank: int, cwd: Path, log: Path) -> Rank:
    """``python worker args`` as ``rank`` in a session of its own, stdout and stderr to ``log``: forked
    from the fork server, or a fresh interpreter when ``PIPECKPT_TEST_FORK=0``."""
    return (forkserver.start if forkserver.enabled() else _fresh)(worker, args, env, rank, cwd, log)


def _fresh(
    worker: Path, args: List[str], env: Dict[str, str], rank: int, cwd: Path, log: Path
) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, str(worker), *args],
            env=env,
            cwd=cwd,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def quiet_trainer(strategy: Any, world: int, **options: Any) -> Any:
    """A worker's ``Trainer``: ``world`` CPU processes under ``strategy``, with nothing but the run
    itself (no logger, checkpoints, progress bar, summary, sanity or validation steps, and no
    distributed sampler: every rank reads the batches its test gives it). ``options`` add or replace."""
    return trainers.quiet_trainer(
        strategy, devices=world, **dict({"use_distributed_sampler": False}, **options)
    )


def serve(run: Callable[[Dict[str, Any], str, int], None]) -> None:
    """A worker's entry point: one torch thread, then ``run(one, out, world)`` for each run of the
    spec that :func:`start` wrote (the world size is read first: Lightning's teardown deletes it)."""
    import torch

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for one in spec["runs"]:
        run(one, spec["out"], world)


def stop(procs: List[Rank]) -> None:
    """Kills every rank still alive, with all it started, and reaps it."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended since: only its status is due
                os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def logs(out: Path, world: int) -> str:
    return _tails(out, range(world))


def _tails(out: Path, ranks: Iterable[int]) -> str:
    """The end of each rank's log, under a ``--- rank r ---`` line."""
    return "\n".join(
        f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text(errors='replace')[-6000:]}" for r in ranks
    )


class Ended(NamedTuple):
    """Ranks :func:`run_some` started, once they ended or were stopped."""

    procs: List[Rank]
    elapsed: float  # seconds from their start until the last exited (or the deadline)
    alive: List[bool]  # each still running at the deadline (then stopped)
    logs: str  # each one's log's end (:func:`_tails`)


def run_some(
    worker: Path, args: List[str], env: Dict[str, str], started: Sequence[int], out: Path, *, within_s: float
) -> Ended:
    """Starts the ranks ``started`` of ``python worker args`` under ``env`` (each with its ``LOCAL_RANK``;
    the world's other ranks never start), waits up to ``within_s`` seconds for them to exit, and always
    stops them: for tests of ranks that fail, or that are missing, where :func:`launch` wants success."""
    procs = [
        spawn(worker, args, dict(env, LOCAL_RANK=str(r)), r, REPO, out / f"rank{r}.log") for r in started
    ]
    begun = time.monotonic()
    try:
        for p in procs:
            p.wait(timeout=max(1.0, within_s - (time.monotonic() - begun)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        elapsed = time.monotonic() - begun
        alive = [p.poll() is None for p in procs]
        stop(procs)
    return Ended(procs, elapsed, alive, _tails(out, started))


def exit_codes(
    worker: Path, world: int, runs: List[Dict[str, Any]], out: Path, *, within_s: float
) -> List[int]:
    """Runs ``runs`` on ``world`` ranks to their end and returns their exit codes; fails the test,
    logs shown, unless every rank exits within ``within_s`` seconds. No rank outlives the call."""
    procs = start(worker, world, runs, out)
    try:
        deadline = time.time() + within_s
        for p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the processes did not finish in {within_s}s:\n{logs(out, world)}")
    finally:
        stop(procs)
    return [p.returncode for p in procs]


def launch(worker: Path, world: int, runs: List[Dict[str, Any]], out: Path, *, within_s: float) -> Path:
    """Runs ``runs`` on ``world`` ranks to the end; fails the test, logs shown, unless every rank
    exits 0 within ``within_s`` seconds. No rank outlives the call."""
    codes = exit_codes(worker, world, runs, out, within_s=within_s)
    assert codes == [0] * world, f"exit codes {codes}:\n{logs(out, world)}"
    return out
