"""Start-up (pipeckpt/engines/distributed/startup.py): every rank waits for the others to start
within ``start_timeout`` (600 s by default), apart from the step ``timeout`` (60 s), so a rank that
starts late is waited for, and one that never starts is named by every rank that waited for it; and
which launcher outside Lightning started the processes (what global rank 0 decides alone is handed on
through the run's store: tests/app/test_layout_handoff.py)."""

import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest
import support.ranks as ranks
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt.engines.distributed.processes import SETTINGS
from pipeckpt.engines.distributed.startup import outside_launcher

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_worker.py"
STRATEGY = dict(balance=[3, 3], chunks=4, schedule="1f1b")


def _only(ranks_started: List[int], runs: List[Dict[str, Any]], out: Path, *, within_s: float) -> Any:
    """Starts ``ranks_started`` of a world of 2 (the others never start); waits for them to exit,
    and always stops them; returns the processes, seconds until the last exited and the logs."""
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    return ranks.run_some(WORKER, [str(spec)], ranks.rank_env(2), ranks_started, out, within_s=within_s)


def test_the_start_up_window_defaults_to_600_s_apart_from_the_step_timeout():
    assert SETTINGS["start_timeout"] == 600.0 and SETTINGS["timeout"] == 60.0


@pytest.mark.parametrize("value", [0, -1, float("inf"), "soon", True])
def test_a_start_timeout_that_is_not_a_positive_finite_number_is_refused(value):
    with pytest.raises(PipeckptConfigError, match=r"start_timeout=.*HINT: set start_timeout in seconds"):
        PipelineStrategy(engine="distributed", stages=2, start_timeout=value)


@pytest.mark.slow
def test_a_rank_that_starts_90_s_late_is_waited_for_under_the_default_settings(tmp_path):
    runs = [dict(name="late", strategy=STRATEGY, steps=2, start_late={"1": 90})]
    ranks.launch(WORKER, 2, runs, tmp_path, within_s=90 + 240)
    assert (tmp_path / "late.rank0.json").is_file() and (tmp_path / "late.rank1.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("started, missing", [([0], 1), ([1], 0)])
def test_a_rank_that_never_starts_is_named_within_the_window_and_no_process_is_left(
    tmp_path, started, missing
):
    window = 20
    runs = [dict(name="alone", strategy=dict(STRATEGY, start_timeout=window), steps=2)]
    procs, elapsed, alive, logs = _only(started, runs, tmp_path, within_s=window + 90)
    assert alive == [False], logs  # it exited on its own
    assert procs[0].returncode != 0 and elapsed < window + 60, logs
    stage = missing  # one replica: rank r runs stage r
    assert re.search(
        rf"rank {missing} \(pipeline stage {stage} of data-parallel replica 0\) did not join the run "
        rf"within start_timeout={window}s",
        logs,
    ), logs
    assert "HINT: look at the output of rank" in logs, logs


def _launched(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    """This process's environment as a launcher would leave it: ``variables`` and nothing of another."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC", "PL_")) or key in (
            "LOCAL_RANK",
            "NODE_RANK",
            "GROUP_RANK",
        ):
            monkeypatch.delenv(key)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


def test_a_process_alone_or_started_by_lightnings_launcher_has_no_outside_launcher(monkeypatch):
    _launched(monkeypatch)
    assert outside_launcher(devices=2, num_nodes=1) is None


def test_torchrun_is_the_outside_launcher_with_its_own_ranks(monkeypatch):
    _launched(
        monkeypatch,
        TORCHELASTIC_RUN_ID="1",
        RANK="3",
        WORLD_SIZE="4",
        LOCAL_RANK="1",
        GROUP_RANK="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    found = outside_launcher(devices=2, num_nodes=2)
    assert isinstance(found, TorchElasticEnvironment)
    assert (found.global_rank(), found.world_size()) == (3, 4)


def test_a_launch_by_hand_gets_its_ranks_as_the_strategy_sets_them(monkeypatch):
    _launched(monkeypatch, LOCAL_RANK="1", NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    found = outside_launcher(devices=2, num_nodes=2)
    assert isinstance(found, LightningEnvironment)
    assert (found.global_rank(), found.world_size()) == (3, 4)


def test_one_process_started_by_an_outside_launcher_hands_nothing_on(monkeypatch):
    _launched(monkeypatch, LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert outside_launcher(devices=1, num_nodes=1) is None


def _handing(tmp_path: Path, work: str) -> ranks.Ended:
    """2 ranks launched by hand running rank_zero_worker.py with rank 0's ``work``, to their end."""
    worker = HERE / "rank_zero_worker.py"
    return ranks.run_some(worker, [work], ranks.rank_env(2), [0, 1], tmp_path, within_s=120)


def test_rank_0s_work_reaches_every_rank_through_the_runs_store(tmp_path):
    ended = _handing(tmp_path, "answers")
    codes, logs = [p.returncode for p in ended.procs], ended.logs
    assert codes == [0, 0] and logs.count("got: rank 0's answer") == 2, logs


def test_a_rank_0_that_stops_during_its_work_is_reported_at_once_not_after_the_window(tmp_path):
    ended = _handing(tmp_path, "dies")
    codes, logs, elapsed = [p.returncode for p in ended.procs], ended.logs, ended.elapsed
    assert codes[0] == 3 and codes[1] != 0, logs
    assert elapsed < 90, logs  # the window is 600 s
    assert re.search(r"rank 1 waited \d+s for the test's work on rank 0, which did not hand it on", logs), (
        logs
    )
