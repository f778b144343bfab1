"""Helpers for the SLURM tests: client commands against the test cluster, reading job results."""

from __future__ import annotations

import csv
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CLUSTER = ROOT / "scripts" / "slurm_cluster.sh"
PYTHON = sys.executable
# States in which a job still holds, or will hold, nodes.
ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "RESIZING",
}


def unavailable(reason: str) -> None:
    """Skips the test, or fails it in CI (`CI` set), where a silent skip would hide a broken setup."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


@dataclass
class Slurm:
    """Client commands against the test cluster; `cancel_all` ends every job when a test ends."""

    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def active_jobs(self) -> list[str]:
        result = self.run("squeue", "-h", "-o", "%i %T", check=False)
        return [line.split()[0] for line in result.stdout.splitlines() if line.split()[1] in ACTIVE]

    def cancel_all(self, timeout: float = 30) -> None:
        """Cancels every job of the cluster (also those srun started) and waits until they are gone,
        so that no training process outlives its test. The cluster belongs to the tests alone."""
        deadline = time.monotonic() + timeout
        while self.active_jobs() and time.monotonic() < deadline:
            self.run("scancel", "--full", "--partition=debug", check=False)
            time.sleep(0.5)


def free_port() -> int:
    """A TCP port free on this host now. Lightning's default under SLURM, 15000 + the job id's last
    four digits, repeats across test sessions because job ids restart at 1 on a fresh cluster."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str | Callable[[], str], poll: float = 0.3
) -> None:
    """Polls `predicate` until it is true; `what` (or what it returns, when it fails) names the wait."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what() if callable(what) else what}"
            )
        time.sleep(poll)


def read_metric(csv_path: Path, name: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric from a Lightning CSVLogger file."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name) not in (None, "")]


def assert_loss_fell(losses: list[tuple[int, float]]) -> None:
    """The mean of the last third of a logged loss is below the mean of the first third."""
    assert len(losses) >= 6, f"too few logged losses to judge: {losses}"
    third = len(losses) // 3
    first = sum(v for _, v in losses[:third]) / third
    last = sum(v for _, v in losses[-third:]) / third
    assert last < first, f"loss did not fall: first third {first:.4f}, last third {last:.4f}: {losses}"


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was written at: a single file, or the distributed engine's sharded
    directory (one shard file per rank that wrote it)."""
    import torch

    from pipeckpt.state import sharded

    if sharded.is_sharded(path):
        return int(sharded.load(path, keys=[])["global_step"])
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


def job_output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"<no output file {path}>"


def sbatch_wait(slurm: Any, workload: Any, run_dir: Path, steps: int, out_dir: Path) -> str:
    """Submits `workload` with `sbatch --wait`, asserts the job exited 0, returns its output."""
    result = slurm.run(
        "sbatch",
        "--wait",
        f"--output={out_dir}/job.out",
        *workload.sbatch_args(run_dir, steps),
        timeout=110,
        check=False,
    )
    output = job_output(out_dir / "job.out")
    assert result.returncode == 0, f"{result.stderr}\n{output}"
    return output


def death_time(output: str) -> float:
    """When the rank that tests/slurm/faults.py kills died (time.time() of that process)."""
    found = re.search(r"faults: rank \d+ dies at global_step=\d+ time=([\d.]+)", output)
    assert found, f"no rank died:\n{output}"
    return float(found.group(1))


def lost_rank_named(output: str, rank: int, survivor_prefix: str = "") -> bool:
    """Whether a survivor's line after the death mentions `rank N`. Lower case only, so that
    Lightning's start-up banner `GLOBAL_RANK: N` does not count."""
    lines = output.splitlines()
    died = next((i for i, line in enumerate(lines) if "faults: rank" in line and " dies at " in line), None)
    if died is None:
        return False
    pattern = re.compile(rf"\brank\s*[=:]?\s*{rank}\b")
    return any(
        line.startswith(survivor_prefix) and "faults:" not in line and pattern.search(line)
        for line in lines[died + 1 :]
    )


def start_steps(output: str) -> list[tuple[int, int, int]]:
    """(restart, rank, global_step) from the lines tests/slurm/faults.py prints when fitting starts."""
    found = re.findall(r"faults: start rank=(\d+) global_step=(\d+) restart=(\d+)", output)
    return [(int(restart), int(rank), int(step)) for rank, step, restart in found]
