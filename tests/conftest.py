"""Fixtures every test folder shares: a quiet Trainer, fixed seeds, and real rank processes that
never outlive their test. The helpers behind them live in ``tests/support``."""

import random
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch
from support import ranks
from support.trainers import quiet_trainer as _quiet_trainer


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: several OpenMP teams (main and pipeline threads) on a busy machine slow
    each other down by an order of magnitude. A file takes it with ``pytestmark``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def quiet_trainer() -> Callable[..., Any]:
    """``quiet_trainer(strategy, devices=1, **options)``: a CPU Trainer that runs and says nothing."""
    return _quiet_trainer


@pytest.fixture
def seeded() -> int:
    """Seeds Python's and torch's generators with 0, and returns the seed."""
    random.seed(0)
    torch.manual_seed(0)
    return 0


@pytest.fixture
def start_ranks() -> Iterator[Callable[[Path, int, List[Dict[str, Any]], Path], List[ranks.Rank]]]:
    """``start_ranks(worker, world, runs, out)`` starts real worker processes (gloo on CPU, one per
    rank, see :func:`support.ranks.start`); every one still alive is killed when the test ends."""
    started: List[ranks.Rank] = []

    def start(worker: Path, world: int, runs: List[Dict[str, Any]], out: Path) -> List[ranks.Rank]:
        procs = ranks.start(worker, world, runs, out)
        started.extend(procs)
        return procs

    yield start
    ranks.stop(started)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group marks
def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``, see pyproject.toml) a test file runs whole on one
    worker, so its module-scoped fixture (often a multi-process run the file's tests read) runs once;
    the SLURM tests share one group because they share one two-node cluster, started once a session."""
    root = Path(__file__).parent
    for item in items:
        where = item.path.relative_to(root)
        group = "slurm" if where.parts[0] == "slurm" else where.as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
    # The SLURM group first: its ten minutes run one test after another on one worker, so it starts
    # while the other worker takes every other file, rather than last, with the other worker idle.
    items.sort(key=lambda item: item.path.relative_to(root).parts[0] != "slurm")
