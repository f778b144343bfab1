"""SIGUSR1 under SLURM, in one process with the local engine: recorded by the handler, acted on at
the next optimizer step (hpc checkpoint, `scontrol requeue`, exit 0), and the resumed run ends
bitwise equal to an uninterrupted one.

SLURM is faked by its environment variables and an `scontrol` on PATH that records its arguments;
tests/slurm/test_preemption_on_cluster.py does the same on the real two-node cluster, both engines.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from support.paths import TESTS

from pipeckpt import PipelineStrategy
from pipeckpt.state.preemption import Preempted, PreemptionCallback

sys.path.insert(0, str(TESTS / "slurm"))  # the SLURM job's own module
from preempt_job import Regression, SignalInjection, data

STEPS = 20  # the loader has 16 batches an epoch
JOB_ID = "4242"


@pytest.fixture(autouse=True)
def default_handlers() -> Iterator[None]:
    """Each test starts with SIGUSR1's default action and leaves SIGUSR1 and SIGTERM as it found them
    (a preempted fit ignores SIGTERM from then on, as the process is meant to exit)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SLURM's variables for one task, and an `scontrol` that appends its arguments to a file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in dict(
        SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="preempt-unit", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
        SLURM_NNODES="1", SLURM_NODELIST="localhost", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
    ).items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return calls


def run(root: Path, **trainer_kwargs: Any) -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu",
        strategy=PipelineStrategy(balance=[4, 3]),
        devices=1,
        max_steps=STEPS,
        default_root_dir=root,
        logger=False,
        use_distributed_sampler=False,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=1), SignalInjection()],
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(Regression(), data())
    return trainer


def final_params(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "final" / "rank0.pt")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as env:  # no SLURM: Lightning's plain environment
        for key in [k for k in os.environ if k.startswith("SLURM_")]:
            env.delenv(key)
        run(root)
    return final_params(root)


def hpc_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


@pytest.mark.parametrize(
    ("phase", "signal_step", "saved_step"),
    [("forward", 3, 4), ("backward", 7, 8), ("optimizer", 15, 16), ("checkpoint", 3, 5)],
)
def test_signal_inside_a_step_saves_at_the_next_boundary_requeues_and_resumes_bitwise(
    phase, signal_step, saved_step, fake_slurm, tmp_path, monkeypatch, uninterrupted
):
    # The signal arrives in the step that starts at global_step `signal_step`: during its forward,
    # backward or optimizer step the boundary is that step's end; during ModelCheckpoint's save at
    # that step's end, which runs after the check, it is the next step's end. Step 15 ends epoch 0.
    monkeypatch.setenv("PIPECKPT_TEST_PREEMPT", f"0:0:{signal_step}:{phase}:self")
    root = tmp_path / "run"
    with pytest.raises(Preempted) as preempted:
        run(root)
    assert preempted.value.code == 0
    assert preempted.value.step == saved_step
    hpc = root / "hpc_ckpt_1.ckpt"
    assert sorted(p.name for p in root.glob("hpc_ckpt_*")) == [hpc.name]
    assert hpc_step(hpc) == saved_step
    assert fake_slurm.read_text().split() == ["requeue", JOB_ID]

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # what the requeued job sees; no signal planned
    resumed = run(root)
    assert resumed.global_step == STEPS
    assert fake_slurm.read_text().split() == ["requeue", JOB_ID]  # not requeued again
    got = final_params(root)
    assert got.keys() == uninterrupted.keys()
    for name in got:
        assert torch.equal(got[name], uninterrupted[name]), name


def test_a_signal_during_gradient_accumulation_waits_for_the_optimizer_step(
    fake_slurm, tmp_path, monkeypatch
):
    # Batch 3 starts at global_step 1 (two batches per step) and is the first of step 1's pair.
    monkeypatch.setenv("PIPECKPT_TEST_PREEMPT", "0:0:1:forward:self")
    with pytest.raises(Preempted) as preempted:
        run(tmp_path, accumulate_grad_batches=2)
    assert preempted.value.step == 2
    assert hpc_step(tmp_path / "hpc_ckpt_1.ckpt") == 2


def test_the_handler_is_ours_during_fit_and_the_default_one_after_even_after_a_preempted_fit(
    fake_slurm, tmp_path, monkeypatch
):
    seen = []

    class Probe(SignalInjection):
        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            super().on_train_start(trainer, pl_module)
            seen.append(signal.getsignal(signal.SIGUSR1))

    monkeypatch.setenv("PIPECKPT_TEST_PREEMPT", "0:0:1:forward:self")
    with pytest.raises(Preempted):
        run(tmp_path / "preempted")  # leaves by an exception: Lightning re-installs our handler
    monkeypatch.delenv("PIPECKPT_TEST_PREEMPT")
    torch.manual_seed(0)
    Trainer(
        accelerator="cpu", strategy=PipelineStrategy(balance=[4, 3]), devices=1, max_steps=1,
        default_root_dir=tmp_path / "plain", logger=False, callbacks=[Probe()], enable_progress_bar=False,
    ).fit(Regression(), data())  # fmt: skip
    assert isinstance(getattr(seen[0], "__self__", None), PreemptionCallback)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_auto_requeue_off_leaves_the_signal_alone(fake_slurm, tmp_path):
    seen = []

    class Probe(SignalInjection):
        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            seen.append(signal.getsignal(signal.SIGUSR1))

    trainer = Trainer(
        accelerator="cpu", strategy=PipelineStrategy(balance=[4, 3]), devices=1, max_steps=1,
        default_root_dir=tmp_path, logger=False, callbacks=[Probe()], enable_progress_bar=False,
        plugins=[SLURMEnvironment(auto_requeue=False)],
    )  # fmt: skip
    trainer.fit(Regression(), data())
    assert seen == [signal.SIG_DFL]
    assert not [
        c for c in trainer.callbacks if isinstance(c, PreemptionCallback) and c.signum == signal.SIGUSR1
    ]
