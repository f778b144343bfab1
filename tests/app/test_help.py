"""Every command answers ``--help`` with its usage and exit status 0, before any work."""

import os
import sys
from pathlib import Path

import pytest
from support import forkserver

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {
    "plan": [sys.executable, "-m", "pipeckpt.plan"],
    "convert": [sys.executable, "-m", "pipeckpt.convert"],
    "train": [sys.executable, "train.py"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_prints_the_usage_and_exits_0(command: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = forkserver.run([*COMMANDS[command], "--help"], cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]
    assert "Traceback" not in done.stderr
