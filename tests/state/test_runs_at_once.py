"""Two runs at once in one checkpoint directory (issue 37, item 2): the run that starts while another
trains there is refused before it writes anything, naming the directory and the other run; the
other run goes on and ends with its own final step in its own last checkpoint. Under the local
engine (the first run in a process of its own, the second in this one) and under the distributed
engine (two two-process runs). The lock goes with the run: a run after it starts as usual."""

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import support.ranks as ranks
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support.toy import ToyModule, fit

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.state import sharded
from pipeckpt.state.final_checkpoint import FinalCheckpoint
from pipeckpt.state.run_lock import LOCK_NAME

WORKER = Path(__file__).resolve().parent / "run_files_worker.py"
START_S = 240  # process start and set-up on a loaded 2-core machine


def held_run(tmp_path: Path, engine: str, world: int) -> tuple:
    """A run of 8 steps in ``tmp_path/checkpoints`` that waits after step 2 until told to go on."""
    out = tmp_path / "held"
    out.mkdir()
    hold = dict(after=2, ready=str(out / "ready"), until=str(out / "go"))
    run = dict(name="held", engine=engine, dir=str(tmp_path / "checkpoints"), steps=8, every=5, hold=hold)
    procs = ranks.start(WORKER, world, [run], out)
    deadline = time.monotonic() + START_S
    while not (out / "ready").exists():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, ranks.logs(out, world)
        time.sleep(0.1)
    return out, procs


def finish(out: Path, procs: List[Any], world: int) -> Dict[str, Any]:
    (out / "go").touch()
    try:
        for p in procs:
            p.wait(timeout=START_S)
    finally:
        ranks.stop(procs)
    assert [p.returncode for p in procs] == [0] * world, ranks.logs(out, world)
    return json.loads((out / "held.rank0.json").read_text())


@pytest.mark.slow
def test_a_local_run_that_starts_while_another_trains_in_its_directory_is_refused(tmp_path):
    out, procs = held_run(tmp_path, "local", 1)
    directory = tmp_path / "checkpoints"
    try:
        before = sorted(os.listdir(directory))
        checkpoints = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=1)
        with pytest.raises(PipeckptConfigError, match="another run is writing to it") as refused:
            fit(
                ToyModule(),
                "pipe",
                steps=3,
                callbacks=[checkpoints, FinalCheckpoint()],
                enable_checkpointing=True,
            )
        assert repr(str(directory)) in str(refused.value) and f"process {procs[0].pid}" in str(refused.value)
        assert sorted(os.listdir(directory)) == before  # nothing written
    finally:
        held = finish(out, procs, 1)
    assert held == {"last": str(directory / "last.ckpt"), "step": 8}
    assert torch.load(directory / "last.ckpt", weights_only=True)["global_step"] == 8
    assert LOCK_NAME not in os.listdir(directory)
    after = fit(
        ToyModule(),
        "pipe",
        steps=2,
        callbacks=[FinalCheckpoint(), ModelCheckpoint(dirpath=directory, save_last=True)],
        enable_checkpointing=True,
    )
    assert after.global_step == 2  # the directory is free again


@pytest.mark.slow
def test_a_distributed_run_that_starts_while_another_trains_in_its_directory_is_refused(tmp_path):
    out, procs = held_run(tmp_path, "distributed", 2)
    directory = tmp_path / "checkpoints"
    try:
        second = tmp_path / "second"
        second.mkdir()
        run = dict(name="second", dir=str(directory), steps=3, every=1)
        codes = ranks.exit_codes(WORKER, 2, [run], second, within_s=START_S)
        assert codes == [1, 1], ranks.logs(second, 2)
        for rank in range(2):
            log = (second / f"rank{rank}.log").read_text()
            assert f"checkpoint directory {str(directory)!r}: another run is writing to it" in log, log[
                -3000:
            ]
    finally:
        held = finish(out, procs, 2)
    assert held == {"last": str(directory / "last.ckpt"), "step": 8}
    assert sharded.load(directory / "last.ckpt")["global_step"] == 8
    assert not (directory / "last-v1.ckpt").exists()
