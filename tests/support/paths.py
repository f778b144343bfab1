"""Where the checkout is, and the PYTHONPATH a worker process needs to import it and the tests' helpers."""

import os
from pathlib import Path
from typing import Dict, Mapping

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
BENCHMARKS = REPO / "benchmarks"


def worker_pythonpath() -> str:
    """This checkout first, then ``tests/`` (``support``) and ``benchmarks/`` (``harness``)."""
    return os.pathsep.join([str(REPO), str(TESTS), str(BENCHMARKS)])


def launcher_free(environ: Mapping[str, str]) -> Dict[str, str]:
    """``environ`` without what a launcher set (SLURM, torchrun, Lightning): a process started with it
    finds its rank and world in what the test gives it, not in the job the tests themselves run in."""
    return {k: v for k, v in environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC", "PL_"))}
