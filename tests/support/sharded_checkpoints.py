"""What the sharded-checkpoint tests share (tests/state/test_sharded.py, the multi-process ones, and
tests/state/test_sharded_one_process.py): the reference model trained in this process, exact equality
of nested state, optimizer state keyed by parameter name, and the environment of a process they start.

The model is tests/state/sharded_worker.py's, imported by its module name as the test files there import
it: pytest puts a test file's folder on ``sys.path`` before importing the file, so this module serves the
tests under tests/state only."""

import os
from typing import Any, Dict

import torch
from sharded_worker import build, names, train
from torch import nn

from pipeckpt.state import sharded
from support.paths import launcher_free, worker_pythonpath


def reference(steps: int) -> tuple:
    """The whole model trained in this process, on one thread like the workers (BatchNorm's
    reductions round differently on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, optimizer = build()
        train(model, optimizer, steps, (0, 1, 2, 3))
    finally:
        torch.set_num_threads(threads)
    return model, optimizer


def equal(a: Any, b: Any) -> bool:
    """Exactly equal nests of dicts, lists and tuples of tensors (same dtype) and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def adam_by_name(optimizer: torch.optim.Optimizer, model: nn.Module) -> Dict[str, Any]:
    """``optimizer``'s state keyed by the names of the model's parameters, as a rank saves it."""
    return sharded.optimizer_state_by_name(optimizer.state_dict(), names(model))


def worker_env(**extra: str) -> Dict[str, str]:
    """This process's environment less a launcher's, with the tests' PYTHONPATH, one thread,
    unbuffered output, and ``extra``."""
    env = launcher_free(os.environ)
    env.update(PYTHONPATH=worker_pythonpath(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env
