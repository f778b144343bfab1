"""kill -9 at random points of a distributed-engine training run.

12 seeded trials of 2 gloo processes x 1 stage (the toy module, 2 micro-batches, dropout 0.3,
checkpoint "always", a sharded checkpoint directory saved every step). Each SIGKILLs rank 0,
rank 1 or both at a point drawn from random.Random(SEED): a forward of a layer (recompute
included), a weight-gradient hook, before or after the optimizer step, partway through a
torch.save of the sharded write (a DCP shard or rank 0's meta file), just before or just after
the rename that puts the finished directory in place. Afterwards: every survivor has exited on
its own within the strategy's `timeout`, naming the lost rank, and no process is left; every
checkpoint directory on disk loads whole; the newest holds the last completed step; resuming
from it in a fresh 2-process run ends bitwise equal to an uninterrupted run.

The processes are tests/faults/kill_worker_distributed.py (one for the kills, one for the resumes; each
forks the two ranks of every training). A failing trial's plan entry is in the assertion message.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from kill_worker import WRITE_KINDS
from support.paths import REPO, launcher_free, worker_pythonpath
from support.toy import assert_bitwise_equal

from pipeckpt.state import sharded

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SEED = 20260612
EPOCHS = 4  # one batch per epoch: every checkpoint is at an epoch boundary
TIMEOUT_S = 30  # the strategy's timeout: every survivor must be gone within it
PHASE_TIMEOUT_S = 400
# (kind, ranks killed): every kill point on each rank that has it, and both ranks at once.
TRIALS: List[Tuple[str, List[int]]] = [
    ("forward", [0]),
    ("forward", [1]),
    ("backward", [1]),
    ("backward", [0, 1]),
    ("optimizer_pre", [0]),
    ("optimizer_post", [1]),
    ("optimizer_post", [0, 1]),
    ("write_bytes", [0]),
    ("write_bytes", [1]),
    ("write_bytes", [0, 1]),
    ("write_before_replace", [0]),  # only rank 0 renames the directory into place
    ("write_after_replace", [0]),
]


def make_plan(root: Path) -> Dict[str, Any]:
    rng = random.Random(SEED)
    trials = [
        dict(dir=str(root / f"t{i:02d}"), kind=kind, ranks=ranks, u=rng.random(), v=rng.uniform(0.02, 0.98))
        for i, (kind, ranks) in enumerate(TRIALS)
    ]
    return dict(
        epochs=EPOCHS,
        mode="always",
        dropout=0.3,
        timeout=TIMEOUT_S,
        reference_dir=str(root / "ref"),
        trials=trials,
    )


_FAILED: Dict[str, str] = {}  # a phase that failed once fails every test that needs it, without re-running


def run_phase(phase: str, plan: Dict[str, Any], root: Path) -> Dict[str, Any]:
    """Runs one phase's process; returns whether processes of its group outlived it."""
    if phase in _FAILED:
        pytest.fail(_FAILED[phase])
    path = root / f"plan-{phase}.json"
    path.write_text(json.dumps(plan))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    env = launcher_free(env)
    env["PYTHONPATH"] = worker_pythonpath()  # this checkout and the tests' helpers
    log_path = root / f"{phase}.log"
    orphans = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "kill_worker_distributed.py"), phase, str(path)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its forked ranks share the group: one killpg ends all
        )
        try:
            code = proc.wait(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            else:
                try:
                    os.killpg(proc.pid, 0)  # anything left in the group outlived the phase
                    orphans = True
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    if code != 0:
        _FAILED[phase] = f"{phase} phase: exit {code}\n{log_path.read_text(errors='replace')[-6000:]}"
        pytest.fail(_FAILED[phase])
    return {"orphans": orphans}


def read(path: Any) -> Any:
    with open(path) as f:
        return json.load(f)


def checkpoint_dirs(directory: str) -> List[str]:
    """What ModelCheckpoint saved: every visible entry (hidden ones are unfinished saves)."""
    root = os.path.join(directory, "ckpt")
    return sorted(os.path.join(root, name) for name in os.listdir(root) if not name.startswith("."))


def newest(directory: str) -> Tuple[int, str]:
    """(global step, path) of the newest checkpoint: the highest step any directory holds."""
    return max(
        (sharded.load(p, keys=[], weights_only=True)["global_step"], p) for p in checkpoint_dirs(directory)
    )


def describe(trial: Dict[str, Any]) -> str:
    targets = read(os.path.join(trial["dir"], "targets.json"))
    return f"trial {os.path.basename(trial['dir'])} (SEED={SEED}, {trial}, targets {targets})"


def uninterrupted(reference_dir: str) -> Dict[str, torch.Tensor]:
    """The final parameters of both ranks as one state dict."""
    merged: Dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        merged.update(torch.load(os.path.join(reference_dir, f"final.rank{rank}.pt"), weights_only=True))
    return merged


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    root = tmp_path_factory.mktemp("killdist")
    plan = make_plan(root)
    start = time.perf_counter()
    plan["kill_phase"] = run_phase("kill", plan, root)
    plan["kill_s"] = time.perf_counter() - start
    yield plan


@pytest.fixture(scope="module")
def resumed(killed: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    root = Path(killed["reference_dir"]).parent
    plan = dict(killed, trials=[dict(t, resume_from=newest(t["dir"])[1]) for t in killed["trials"]])
    start = time.perf_counter()
    plan["resume_phase"] = run_phase("resume", plan, root)
    plan["resume_s"] = time.perf_counter() - start
    print(
        f"\n{len(plan['trials'])} distributed kill trials: kills {killed['kill_s']:.1f}s, "
        f"resumes {plan['resume_s']:.1f}s"
    )
    yield plan


def test_the_reference_run_trains_uninterrupted(killed):
    status = read(os.path.join(killed["reference_dir"], "status-kill.json"))
    assert [(s["signal"], s["exit_code"], s["timed_out"]) for s in status] == [(None, 0, False)] * 2
    for rank in (0, 1):
        assert read(os.path.join(killed["reference_dir"], f"result.rank{rank}.json"))["global_step"] == EPOCHS


def test_every_targeted_rank_dies_by_sigkill_and_every_survivor_fails_on_its_own(killed):
    """A rank killed alone always dies by SIGKILL; of two killed at once, one may fail first when its
    peer dies. No rank is left for the parent's deadline to kill."""
    for trial in killed["trials"]:
        status = read(os.path.join(trial["dir"], "status-kill.json"))
        assert not any(s["timed_out"] for s in status), describe(trial)
        killed_by_sigkill = [r for r in (0, 1) if status[r]["signal"] == signal.SIGKILL]
        failed = [
            r for r in (0, 1) if status[r]["signal"] is None and status[r]["exit_code"] not in (None, 0)
        ]
        assert sorted(killed_by_sigkill + failed) == [0, 1], describe(trial)
        if len(trial["ranks"]) == 1:
            assert killed_by_sigkill == trial["ranks"], describe(trial)
        else:
            assert killed_by_sigkill, describe(trial)


def test_every_survivor_is_gone_within_the_timeout_of_the_first_death(killed):
    for trial in killed["trials"]:
        status = read(os.path.join(trial["dir"], "status-kill.json"))
        first_death = min(s["ended"] for s in status if s["signal"] == signal.SIGKILL)
        last_end = max(s["ended"] for s in status)
        assert last_end - first_death < TIMEOUT_S, describe(trial)


def test_a_survivor_names_the_rank_that_was_killed(killed):
    for trial in killed["trials"]:
        status = read(os.path.join(trial["dir"], "status-kill.json"))
        if len(trial["ranks"]) != 1:
            continue  # with both killed, a survivor may also find the store gone or its peer alive
        (lost,) = trial["ranks"]
        survivor = 1 - lost
        assert status[survivor]["exit_code"] == 1, describe(trial)
        log = Path(trial["dir"], f"rank{survivor}.kill.log").read_text(errors="replace")
        assert re.search(rf"^pipeckpt: lost rank {lost}\b", log, re.MULTILINE), (
            f"{describe(trial)}\n{log[-3000:]}"
        )


def test_no_process_outlives_a_phase(killed, resumed):
    assert killed["kill_phase"] == {"orphans": False}
    assert resumed["resume_phase"] == {"orphans": False}


def test_every_checkpoint_on_disk_loads_whole_after_a_kill(killed):
    keys = set(uninterrupted(killed["reference_dir"]))
    for trial in killed["trials"]:
        dirs = checkpoint_dirs(trial["dir"])
        assert dirs, describe(trial)
        for path in dirs:
            assert sharded.is_sharded(path), f"{path}: {describe(trial)}"
            try:
                state = sharded.load(path, weights_only=True)
            except Exception as error:  # a shard cut short raises here
                pytest.fail(f"{path} does not load ({error!r}): {describe(trial)}")
            assert set(state["state_dict"]) == keys, f"{path}: {describe(trial)}"
            (optimizer,) = state["optimizer_states"]
            assert set(optimizer["state"]) == keys, f"{path}: {describe(trial)}"  # Adam: every parameter


def test_the_newest_checkpoint_holds_the_last_completed_step(killed):
    """A kill during training loses only the step in progress; a kill during the save of step s
    leaves step s - 1, or step s once its directory is in place."""
    reference = [read(os.path.join(killed["reference_dir"], f"result.rank{r}.json")) for r in (0, 1)]
    for trial in killed["trials"]:
        targets = read(os.path.join(trial["dir"], "targets.json"))
        steps = {reference[int(r)]["events"][t["kind"]][t["index"]] for r, t in targets.items()}
        step_at_kill = min(steps)
        step, _ = newest(trial["dir"])
        if trial["kind"] == "write_after_replace":
            assert step == step_at_kill, describe(trial)
        elif trial["kind"] in WRITE_KINDS:
            assert step == step_at_kill - 1, describe(trial)
        else:
            assert step == step_at_kill, describe(trial)


def test_resuming_from_the_newest_checkpoint_ends_bitwise_equal_to_an_uninterrupted_run(resumed):
    expected = uninterrupted(resumed["reference_dir"])
    for trial in resumed["trials"]:
        status = read(os.path.join(trial["dir"], "status-resume.json"))
        assert [(s["signal"], s["exit_code"], s["timed_out"]) for s in status] == [(None, 0, False)] * 2, (
            describe(trial)
        )
        for rank in (0, 1):
            assert read(os.path.join(trial["dir"], f"result.rank{rank}.json"))["global_step"] == EPOCHS
        try:
            assert_bitwise_equal(uninterrupted(trial["dir"]), expected)
        except AssertionError as error:
            raise AssertionError(f"{describe(trial)}: {error}") from None
