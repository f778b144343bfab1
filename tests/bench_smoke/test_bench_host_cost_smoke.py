"""The host-cost benchmark runs end to end (a tiny model, two rounds; its workers assert pipeckpt's
losses and weights equal to the raw script's to the bit); no figure is asserted."""

from pathlib import Path

import pytest
from support.benchmarks import run_benchmark

ROWS = ("whole step", "schedule:", "the rest:", "main threads only", "rank 0", "rank 1", "wall time per step")


@pytest.mark.slow
def test_quick_run_matches_the_raw_script_and_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "host_cost.md"
    run_benchmark("bench_host_cost.py", "--quick", "--out", str(out))
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    for name in ROWS:
        (row,) = [r for r in rows if r.startswith(f"| {name}")]
        assert float(row.split("|")[-2]) > 0, row


@pytest.mark.slow
def test_calls_mode_counts_every_methods_python_calls_per_step_on_each_rank(tmp_path: Path) -> None:
    out = tmp_path / "host_calls.md"
    run_benchmark("bench_host_cost.py", "--quick", "--calls", "--out", str(out))
    lines = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in lines}
    for method in ("raw", "lightning", "pipeckpt"):
        rank0, rank1, both = (float(cell) for cell in rows[method])
        # each figure is rounded on its own
        assert rank0 > 0 and rank1 > 0 and abs(both - (rank0 + rank1)) <= 1, (method, rows[method])


@pytest.mark.slow
def test_parts_mode_reports_every_part_of_a_step_on_each_rank(tmp_path: Path) -> None:
    out = tmp_path / "host_parts.md"
    run_benchmark("bench_host_cost.py", "--quick", "--parts", "--out", str(out))
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ")]
    parts = {(row[0].strip(), row[1].strip()) for row in rows[1:]}  # below the header
    for rank in ("0", "1"):
        assert ("whole step (main thread)", rank) in parts
        assert ("the optimizer and zeroing", rank) in parts
    (step,) = [row for row in rows[1:] if row[:2] == [" whole step (main thread) ", " 0 "]]
    assert float(step[2]) > 0 and float(step[3]) > 0, step  # both runs' steps measured


@pytest.mark.slow
def test_cold_calls_probe_reports_each_call_after_the_kernels_and_warm(tmp_path: Path) -> None:
    out = tmp_path / "cold_calls.md"
    run_benchmark("bench_cold_calls.py", "--rounds", "3", "--out", str(out))
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ")]
    calls = rows[1:]  # below the header
    assert len(calls) == 5, rows
    empty = calls[-1]
    assert float(empty[1]) > 0 and float(empty[2]) > 0, empty  # the timer's own cost, measured
    for _, cold, warm, _ in calls[:-1]:
        float(cold), float(warm)  # every call measured both ways (its time less the timer's)
