"""Real worker processes for the multi-process tests: one per rank, gloo on CPU.

Each test file names its worker script and hands it a JSON spec of runs; every process runs in
a session of its own, so a test can always kill a rank and everything it started."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest

from support import trainers
from support.paths import REPO, worker_pythonpath


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(worker: Path, world: int, runs: List[Dict[str, Any]], out: Path) -> List[subprocess.Popen]:
    """Starts ``world`` ranks of ``worker`` on ``runs``; each writes ``out/rank<r>.log``."""
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC", "PL_"))}
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
    procs = []
    for rank in range(world):
        with open(out / f"rank{rank}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), str(spec)],
                    env=dict(env, LOCAL_RANK=str(rank)),
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


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


def stop(procs: List[subprocess.Popen]) -> None:
    """Kills every rank still alive, with all it started, and reaps it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def logs(out: Path, world: int) -> str:
    return "\n".join(
        f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text(errors='replace')[-6000:]}"
        for r in range(world)
    )


def launch(worker: Path, world: int, runs: List[Dict[str, Any]], out: Path, *, within_s: float) -> Path:
    """Runs ``runs`` on ``world`` ranks to the end; fails the test, logs shown, unless every rank
    exits 0 within ``within_s`` seconds. No rank outlives the call."""
    procs = start(worker, world, runs, out)
    try:
        deadline = time.time() + within_s
        for p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the processes did not finish in {within_s}s:\n{logs(out, world)}")
    finally:
        stop(procs)
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}:\n{logs(out, world)}"
    return out
