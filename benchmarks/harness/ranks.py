"""Starts a benchmark's ranks itself, as torchrun would, so no launcher process competes for a core:
each rank runs ``script --worker <spec.json>`` and writes ``rank<r>.json`` (a list of rows)."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

if TYPE_CHECKING:
    import argparse


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, ranks: int, spec: Dict[str, Any], *, timeout: float) -> List[Dict[str, Any]]:
    """Every rank's rows, in rank order; a failing rank raises with the ranks' output, and no rank
    outlives the call."""
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "spec.json")
        with open(path, "w") as f:
            json.dump({"out": out, **spec}, f)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            WORLD_SIZE=str(ranks),
            NODE_RANK="0",
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
        )
        procs = [
            subprocess.Popen(
                [sys.executable, script, "--worker", path],
                env=dict(env, LOCAL_RANK=str(r)),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            for r in range(ranks)
        ]
        try:
            outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError("a pipeline process failed:\n" + "\n".join(o[-4000:] for o in outputs))
        results: List[Dict[str, Any]] = []
        for r in range(ranks):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results += json.load(f)
        return results


def joined(spec_path: str) -> Tuple[Dict[str, Any], "argparse.Namespace"]:
    """One rank's side of :func:`run_ranks`: one torch thread, the spec it wrote (its ``args`` as the
    benchmark's namespace), and the gloo group of the ranks it started, joined (a Lightning strategy
    finds it up and keeps it)."""
    import argparse

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=world)
    return spec, argparse.Namespace(**spec["args"])


def ranks_arguments(description: str, *, out: str, rounds: int, batch: int) -> "argparse.ArgumentParser":
    """The command line every multi-process benchmark shares (its worker entry, where the table goes,
    rounds, batch, warm-up and timed steps, a timeout, ``--quick``); a benchmark adds its own."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=out)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timed", type=int, default=6)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps: checks the harness")
    return parser
