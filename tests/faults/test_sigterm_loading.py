"""SIGTERM while a 2-process ``model=hf`` run reads its pretrained weights (issue 45): the signalled
rank says in one line that SIGTERM stopped it while loading, and what it was reading; so does the
other rank, to which the signal is passed on (by the launching rank to the rank it started, or by
its watch of that rank to itself); the job exits 143, SIGTERM's code, not 137 (SIGKILL, which reads
as out of memory) as Lightning's watch of its ranks made it. Deterministic: each rank holds its read
until the test has signalled (tests/support/held_load.py), so the signal always lands in the load."""

import os
import re
import signal
import time
from pathlib import Path
from typing import Dict

import pytest
from support import forkserver
from support.held_load import FOLDER
from support.paths import REPO, launcher_free, worker_pythonpath

from pipeckpt.app.tiny_pretrained import make_tiny_pretrained

RUN = ["trainer=fast", "trainer.enable_progress_bar=false", "threads=1", "validate=false"]
RUN += ["data.max_bytes=200000", "trainer.accelerator=cpu", "trainer.max_steps=1", "model=hf"]
RUN += ["model._target_=support.held_load.HFCausalLM", "strategy.engine=distributed", "trainer.devices=2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


def _loading(folder: Path, job: forkserver.Forked, log: Path) -> Dict[int, int]:
    """The PID of each rank, once both are inside their read of the weights."""
    deadline = time.monotonic() + 300
    while not all((folder / f"rank{r}").exists() for r in (0, 1)):
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return {r: int((folder / f"rank{r}").read_text()) for r in (0, 1)}


def _gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` has ended (a zombie has) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("signalled", [0, 1], ids=["to-rank-0", "to-rank-1"])
def test_sigterm_while_loading_is_said_by_every_rank_and_ends_the_job_with_143(tmp_path, tiny, signalled):
    folder, log = tmp_path / "loading", tmp_path / "log"
    folder.mkdir()
    env = dict(launcher_free(os.environ), PYTHONPATH=worker_pythonpath(), **{FOLDER: str(folder)})
    args = [*RUN, f"model.path={tiny}", f"hydra.run.dir={tmp_path / 'run'}"]
    job = forkserver.start(REPO / "train.py", args, env, 0, REPO, log)
    try:
        pids = _loading(folder, job, log)
        os.kill(pids[signalled], signal.SIGTERM)
        code = job.wait(timeout=120)
        assert _gone(pids[1], timeout=60)
    finally:
        (folder / "go").touch()  # a rank still holding its read lets go, and is ended here
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output = log.read_text()
    assert code == 143, output[-3000:]
    said = re.findall(
        rf"^pipeckpt: rank (\d) stopped by SIGTERM while loading the model \(reading its pretrained "
        rf"weights from {re.escape(repr(str(tiny)))}\), before the first step: nothing was trained or "
        rf"saved; exiting with 143$",
        output,
        flags=re.M,
    )
    assert sorted(said) == ["0", "1"], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
