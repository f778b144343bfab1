"""A run writes only its own files (issue 37), under the distributed engine: two two-process runs
one after the other in one checkpoint directory. The second run's sharded checkpoints go to
``last-v1.ckpt``, the name Lightning's ModelCheckpoint gave it, and the first run's ``last.ckpt``
keeps the first run's final step. The local engine's runs are in test_run_files.py."""

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import support.ranks as ranks

from pipeckpt.state import sharded

WORKER = Path(__file__).resolve().parent / "run_files_worker.py"
START_S = 240  # process start and two fits on a loaded 2-core machine


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_runs")
    directory = str(out / "checkpoints")
    runs = [
        dict(name="first", dir=directory, steps=8, every=5),
        dict(name="second", dir=directory, steps=7, every=5),
    ]
    return ranks.launch(WORKER, 2, runs, out, within_s=START_S)


def reported(out: Path, name: str) -> Dict[str, Any]:
    """The run's report, the same on both ranks."""
    seen = [json.loads((out / f"{name}.rank{rank}.json").read_text()) for rank in range(2)]
    assert seen[0] == seen[1], seen
    return seen[0]


@pytest.mark.slow
def test_each_run_reports_a_final_checkpoint_holding_its_own_final_step(two_runs):
    for name, step in (("first", 8), ("second", 7)):
        run = reported(two_runs, name)
        assert run["step"] == step
        assert sharded.load(run["last"])["global_step"] == step


@pytest.mark.slow
def test_the_second_run_writes_a_new_version_and_leaves_the_first_runs_last_checkpoint(two_runs):
    assert reported(two_runs, "first")["last"] == str(two_runs / "checkpoints" / "last.ckpt")
    assert reported(two_runs, "second")["last"] == str(two_runs / "checkpoints" / "last-v1.ckpt")
    assert sharded.load(two_runs / "checkpoints" / "last.ckpt")["global_step"] == 8
