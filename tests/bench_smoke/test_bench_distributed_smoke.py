"""The distributed-engine benchmark runs end to end (a tiny model, one round); no figure is asserted."""

from pathlib import Path

import pytest
from support.benchmarks import run_benchmark


@pytest.mark.slow
def test_quick_run_reports_every_schedule_and_microbatch_count(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS_distributed.md"
    run_benchmark("bench_distributed.py", "--quick", "--out", str(out))
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    for m in (2, 4, 8):
        for schedule in ("gpipe", "1f1b"):
            assert sum(r.startswith(f"| {m} | {schedule} |") for r in rows) == 1, rows
        assert sum(r.startswith(f"| {m} | ") and r.count("|") == 6 for r in rows) == 2, (
            rows
        )  # memory, 2 ranks
