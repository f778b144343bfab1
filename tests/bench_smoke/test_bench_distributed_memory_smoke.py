"""The distributed memory benchmark's figures agree with each other (GPipe, GPT, never and always).

One launch of the benchmark (two gloo processes) serves every test here. The figures it reports
must be consistent with what the modes and the model are: ``always`` keeps only each stage's input
per micro-batch, so it peaks below ``never`` on every rank of a GPT (activations outweigh
parameters); it recomputes every micro-batch once and ``never`` none; and none of the previous
step's gradients is alive while the schedule runs.
"""

import json
from typing import Any, Dict, List

import pytest
from support.benchmarks import ROOT, run_benchmark

CHUNKS = 4  # the benchmark's micro-batches per step


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    out = tmp_path_factory.mktemp("distmem")
    figures = out / "figures.json"
    done = run_benchmark(
        "bench_distributed_memory.py",
        "--models",
        "gpt",
        "--schedules",
        "gpipe",
        "--modes",
        "never,always",
        "--json",
        str(figures),
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        timeout=300,  # the benchmark kills its two processes itself at its own timeout
    )
    return {"rows": json.loads(figures.read_text()), "text": done.stdout}


def _by(rows: List[Dict[str, Any]], mode: str) -> Dict[int, Dict[str, Any]]:
    return {r["rank"]: r for r in rows if r["mode"] == mode}


@pytest.mark.slow
def test_always_peaks_below_never_on_every_rank(run: Dict[str, Any]) -> None:
    never, always = _by(run["rows"], "never"), _by(run["rows"], "always")
    assert sorted(never) == sorted(always) == [0, 1]
    for rank in (0, 1):
        assert 0 < always[rank]["peak"] < never[rank]["peak"], (rank, always[rank], never[rank])


@pytest.mark.slow
def test_always_recomputes_each_microbatch_once_and_never_none(run: Dict[str, Any]) -> None:
    for row in _by(run["rows"], "always").values():
        assert row["recomputes"] == CHUNKS * len(row["stages"]), row
    for row in _by(run["rows"], "never").values():
        assert row["recomputes"] == 0, row


@pytest.mark.slow
def test_no_previous_gradients_stay_alive_while_the_schedule_runs(run: Dict[str, Any]) -> None:
    # Every batch opens a window (no accumulation): the engine drops .grad before the schedule.
    for row in run["rows"]:
        assert row["previous_grads"] == 0 < row["param_bytes"], row


@pytest.mark.slow
def test_report_has_a_row_per_mode_and_rank_with_a_prediction(run: Dict[str, Any]) -> None:
    rows = [line for line in run["text"].splitlines() if line.startswith("| gpt | gpipe |")]
    assert len(rows) == 4, rows
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 10, cells
        assert cells[8] != "-" and cells[9] != "-", cells  # GPipe is a schedule the model predicts


@pytest.mark.slow
def test_predicted_peaks_are_within_ten_percent_of_the_measured(run: Dict[str, Any]) -> None:
    # The acceptance: pipeckpt.memory.predict.predict per rank, against the peak the rank measured.
    rows = [line for line in run["text"].splitlines() if line.startswith("| gpt | gpipe |")]
    errors = [float(line.strip("|").split("|")[9]) for line in rows]
    assert len(errors) == 4 and all(abs(e) <= 10.0 for e in errors), rows
