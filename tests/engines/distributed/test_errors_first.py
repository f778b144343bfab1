"""The real error first, on every rank, whatever the phase: one rank of a two-process distributed run
raises at set-up, at checkpoint load or inside a step; it shows its own error as raised, every other
rank's output starts with that error quoted (rank, stage, type, message), nobody speaks of a lost or
hung rank, and every process is gone within the strategy's ``timeout``. A configuration error under
the distributed engine prints through ``train.py`` the same text as under the local engine."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import support.ranks as ranks
from support import forkserver
from support.paths import REPO, worker_pythonpath
from support.toy import ToyModule, toy_loader

from pipeckpt import PipelineStrategy

HERE = Path(__file__).resolve().parent
ROOT = REPO
WORKER = HERE / "errors_first_worker.py"
TIMEOUT_S = 20
START_S = 240  # process start and set-up on a loaded 2-core machine


@pytest.fixture(scope="module")
def single_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    trainer = ranks.quiet_trainer(PipelineStrategy(balance=[3, 3], chunks=2), 1, max_steps=1)
    trainer.fit(ToyModule(), toy_loader())
    trainer.save_checkpoint(out / "one.ckpt")
    return out / "one.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["setup", "load", "step"])
def test_every_rank_starts_with_the_raising_ranks_own_error(tmp_path, single_file, phase):
    run = dict(phase=phase, rank=1, timeout=TIMEOUT_S, resume=str(single_file) if phase == "load" else None)
    procs = ranks.start(WORKER, 2, [run], tmp_path)
    try:
        for p in procs:
            p.wait(timeout=START_S)
        ended = time.time()
    except subprocess.TimeoutExpired:
        pytest.fail(f"the ranks did not exit:\n{ranks.logs(tmp_path, 2)}")
    finally:
        ranks.stop(procs)
    output = ranks.logs(tmp_path, 2)
    assert [p.returncode for p in procs] == [1, 1], output
    raiser, survivor = (tmp_path / "rank1.log").read_text(), (tmp_path / "rank0.log").read_text()
    raised = re.search(r"worker: rank 1 raises at time=([\d.]+)", raiser)
    assert raised and ended - float(raised.group(1)) < TIMEOUT_S, output
    message = "the last layer refuses micro-batch 1 of step 1" if phase == "step" else f"injected at {phase}"
    for text in (raiser, survivor):
        assert "failed in a collective" not in text and "lost rank" not in text, output
    # The raising rank: its own error as raised, never a diagnosis of the others.
    assert f"ValueError: {message}" in raiser and "pipeckpt: rank" not in raiser, output
    # The survivor: its first words after the failure quote rank 1's error.
    quoted = re.search(
        rf"pipeckpt: rank 1 \(pipeline stage 1 of data-parallel replica 0\) raised ValueError: {message}",
        survivor,
    )
    assert quoted, output
    assert "Traceback" not in survivor[: quoted.start()], output


@pytest.mark.slow
def test_a_configuration_error_prints_the_same_under_both_engines(tmp_path):
    def configuration_error(engine: str) -> str:
        command = [
            sys.executable,
            "train.py",
            "trainer=fast",
            "trainer.enable_progress_bar=false",
            "threads=1",
        ]
        command += [
            "model=mlp",
            "validate=false",
            f"hydra.run.dir={tmp_path / engine}",
            "ckpt.modes=[always,never,never]",
        ]
        command += [f"strategy.engine={engine}", "trainer.accelerator=cpu"]
        command += ["trainer.devices=2", "strategy.timeout=20"] if engine == "distributed" else []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PL_"))}
        env["PYTHONPATH"] = worker_pythonpath()
        done = forkserver.run(command, cwd=ROOT, env=env, timeout=300)
        assert done.returncode == 1, done.stderr[-3000:]
        lines = [line for line in done.stderr.splitlines() if line.startswith("Configuration error")]
        assert lines, done.stderr[-3000:]
        assert "failed in a collective" not in done.stdout + done.stderr, done.stdout[-3000:]
        return lines[0]

    assert configuration_error("distributed") == configuration_error("local")
