"""A SLURM job named `bash` or `interactive` makes Lightning ignore SLURM; pipeckpt must say so.

Lightning then launches this node's processes itself, so with several SLURM tasks every task starts
its own run and the runs hang waiting for each other: the warning is the only clue the user gets.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
from slurm_helpers import PYTHON

import pipeckpt  # noqa: F401  (registers the "pipe" strategy)
from pipeckpt import PipeckptWarning

IGNORED_NAMES = ["bash", "interactive"]


def _slurm_task_env(monkeypatch: pytest.MonkeyPatch, name: str, ntasks: int) -> None:
    monkeypatch.setenv("SLURM_JOB_NAME", name)
    monkeypatch.setenv("SLURM_NTASKS", str(ntasks))
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", str(ntasks))
    monkeypatch.setenv("SLURM_NNODES", "1")
    monkeypatch.setenv("SLURM_NODELIST", "n1")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_NODEID", "0")


@pytest.mark.parametrize("name", IGNORED_NAMES)
def test_warns_that_slurm_is_ignored_for_interactive_job_names(monkeypatch, name):
    _slurm_task_env(monkeypatch, name, ntasks=2)
    with pytest.warns(PipeckptWarning, match=rf"(?s)SLURM.*{name}.*HINT"):
        L.Trainer(strategy="pipe", accelerator="cpu", devices=1, logger=False)


def test_no_warning_for_a_named_job(monkeypatch):
    _slurm_task_env(monkeypatch, "pipeckpt", ntasks=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(strategy="pipe", accelerator="cpu", devices=1, logger=False)
    assert not [w for w in caught if issubclass(w.category, PipeckptWarning)]


def test_no_warning_outside_slurm(monkeypatch):
    for key in ("SLURM_JOB_NAME", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(strategy="pipe", accelerator="cpu", devices=1, logger=False)
    assert not [w for w in caught if issubclass(w.category, PipeckptWarning)]


@pytest.mark.slow
def test_warns_under_a_real_srun_named_bash(slurm):
    program = (
        "import lightning as L, pipeckpt\n"
        "L.Trainer(strategy='pipe', accelerator='cpu', devices=1, logger=False)\n"
    )
    result = slurm.run("srun", "-J", "bash", "-N1", "-n1", PYTHON, "-W", "always", "-c", program, timeout=60)
    assert "PipeckptWarning" in result.stderr and "bash" in result.stderr, result.stderr
