"""Where the checkout is, and the PYTHONPATH a worker process needs to import it and the tests' helpers."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"


def worker_pythonpath() -> str:
    """This checkout first, then ``tests/`` (``support``) and ``benchmarks/`` (``harness``)."""
    return os.pathsep.join([str(REPO), str(TESTS), str(BENCHMARKS)])
