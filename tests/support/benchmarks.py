"""Runs a benchmark script as a user would, for the smoke tests: from the project root, output
captured, the test failing with the script's own last output when it exits non-zero."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

from support import forkserver

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    script: str, *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 600
) -> "subprocess.CompletedProcess[str]":
    """``python benchmarks/<script> <args>``; ``env`` adds to this process's environment."""
    done = forkserver.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
