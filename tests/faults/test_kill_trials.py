"""kill -9 at random points of a local-engine training run.

28 trials, 4 per kill point (forward, backward, optimizer step pre/post, and three moments of a
checkpoint write: mid-bytes, before the rename, after it). Each trial trains the toy module
(2 stages, 2 micro-batches, dropout 0.3, checkpoint "always") with AtomicCheckpointIO and a
ModelCheckpoint saving every step, and SIGKILLs itself at a point drawn from random.Random(SEED).
Afterwards every checkpoint on disk must load, the newest must hold the last completed step,
and resuming from it must end bitwise equal to an uninterrupted run.

The processes are tests/faults/kill_worker.py (one for the kills, one for the resumes; each forks a
child per training). To reproduce one failing trial, its plan entry is in the assertion message.
"""

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch
from kill_worker import KINDS, WRITE_KINDS
from support.paths import REPO, worker_pythonpath
from support.toy import assert_bitwise_equal

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SEED = 20260611
TRIALS_PER_KIND = 4
EPOCHS = 5  # one batch per epoch: every checkpoint is at an epoch boundary
PHASE_TIMEOUT_S = 300


def make_plan(root: Path) -> Dict[str, Any]:
    rng = random.Random(SEED)
    trials = []
    for i in range(TRIALS_PER_KIND * len(KINDS)):
        # Directory names of equal length, so that checkpoints of equal steps have equal sizes
        # and a byte offset drawn from the reference run's size falls inside the trial's file.
        trials.append(
            dict(
                dir=str(root / f"t{i:02d}"),
                kind=KINDS[i % len(KINDS)],
                u=rng.random(),
                v=rng.uniform(0.02, 0.98),
            )
        )
    return dict(epochs=EPOCHS, mode="always", dropout=0.3, reference_dir=str(root / "ref"), trials=trials)


_FAILED: Dict[str, str] = {}  # a phase that failed once fails every test that needs it, without re-running


def run_phase(phase: str, plan: Dict[str, Any], root: Path) -> None:
    if phase in _FAILED:
        pytest.fail(_FAILED[phase])
    path = root / f"plan-{phase}.json"
    path.write_text(json.dumps(plan))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = worker_pythonpath()  # this checkout and the tests' helpers
    log_path = root / f"{phase}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "kill_worker.py"), phase, str(path)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its forked children share the group: one killpg ends all
        )
        try:
            code = proc.wait(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None or code is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            else:
                with _no_such_group():
                    os.killpg(proc.pid, signal.SIGKILL)  # a child left behind, if any
    if code != 0:
        _FAILED[phase] = f"{phase} phase: exit {code}\n{log_path.read_text(errors='replace')[-6000:]}"
        pytest.fail(_FAILED[phase])


class _no_such_group:
    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: Any, *_: Any) -> bool:
        return kind is ProcessLookupError


def read(path: Any) -> Any:
    with open(path) as f:
        return json.load(f)


def checkpoints(directory: str) -> List[str]:
    """The checkpoint files ModelCheckpoint sees (hidden temporary files are not among them)."""
    return sorted(glob.glob(os.path.join(directory, "*.ckpt")))


def describe(trial: Dict[str, Any]) -> str:
    target = read(os.path.join(trial["dir"], "target.json"))
    return f"trial {os.path.basename(trial['dir'])} (SEED={SEED}, {trial}, target {target})"


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    root = tmp_path_factory.mktemp("kill")
    plan = make_plan(root)
    start = time.perf_counter()
    run_phase("kill", plan, root)
    plan["kill_s"] = time.perf_counter() - start
    yield plan


@pytest.fixture(scope="module")
def resumed(killed: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    root = Path(killed["reference_dir"]).parent
    plan = dict(killed, trials=[dict(t, resume_from=newest(t["dir"])[1]) for t in killed["trials"]])
    start = time.perf_counter()
    run_phase("resume", plan, root)
    plan["resume_s"] = time.perf_counter() - start
    print(
        f"\n{len(plan['trials'])} kill trials: kills {killed['kill_s']:.1f}s, resumes {plan['resume_s']:.1f}s"
    )
    yield plan


def newest(directory: str) -> Any:
    """(global step, path) of the newest checkpoint: the highest step any file holds."""
    steps = [(torch.load(p, weights_only=True)["global_step"], p) for p in checkpoints(directory)]
    return max(steps)


def test_the_reference_run_trains_uninterrupted(killed):
    status = read(os.path.join(killed["reference_dir"], "status-kill.json"))
    assert status == {"signal": None, "exit_code": 0, "timed_out": False}
    assert read(os.path.join(killed["reference_dir"], "result.json"))["global_step"] == EPOCHS


def test_every_trial_dies_by_sigkill_at_its_point(killed):
    for trial in killed["trials"]:
        status = read(os.path.join(trial["dir"], "status-kill.json"))
        assert status == {"signal": 9, "exit_code": None, "timed_out": False}, describe(trial)


def test_every_checkpoint_on_disk_loads_after_a_kill(killed):
    keys = set(torch.load(os.path.join(killed["reference_dir"], "final.pt"), weights_only=True))
    for trial in killed["trials"]:
        files = checkpoints(trial["dir"])
        assert files, describe(trial)
        for path in files:
            try:
                state = torch.load(path, weights_only=True)
            except Exception as error:  # a truncated file raises here
                pytest.fail(f"{path} does not load ({error!r}): {describe(trial)}")
            assert set(state["state_dict"]) == keys, f"{path}: {describe(trial)}"


def test_the_newest_checkpoint_holds_the_last_completed_step(killed):
    """A kill during training loses only the step in progress; a kill during the writes of step s
    leaves step s (the other file of that step was complete) or step s - 1."""
    reference = read(os.path.join(killed["reference_dir"], "result.json"))
    for trial in killed["trials"]:
        target = read(os.path.join(trial["dir"], "target.json"))
        step_at_kill = reference["events"][target["kind"]][target["index"]]
        step, _ = newest(trial["dir"])
        if trial["kind"] in WRITE_KINDS:
            assert step in (step_at_kill - 1, step_at_kill), describe(trial)
            if trial["kind"] == "write_after_replace":
                assert step == step_at_kill, describe(trial)
        else:
            assert step == step_at_kill, describe(trial)


def test_a_kill_mid_write_leaves_only_a_hidden_temporary_file(killed):
    for trial in killed["trials"]:
        leftovers = [name for name in os.listdir(trial["dir"]) if name.endswith(".tmp")]
        if trial["kind"] in ("write_bytes", "write_before_replace"):
            assert len(leftovers) == 1 and leftovers[0].startswith("."), describe(trial)
        else:
            assert leftovers == [], describe(trial)


def test_resuming_from_the_newest_checkpoint_ends_bitwise_equal_to_an_uninterrupted_run(resumed):
    uninterrupted = torch.load(os.path.join(resumed["reference_dir"], "final.pt"), weights_only=True)
    for trial in resumed["trials"]:
        status = read(os.path.join(trial["dir"], "status-resume.json"))
        assert status == {"signal": None, "exit_code": 0, "timed_out": False}, describe(trial)
        assert read(os.path.join(trial["dir"], "result.json"))["global_step"] == EPOCHS, describe(trial)
        final = torch.load(os.path.join(trial["dir"], "final.pt"), weights_only=True)
        try:
            assert_bitwise_equal(final, uninterrupted)
        except AssertionError as error:
            raise AssertionError(f"{describe(trial)}: {error}") from None
