"""The distributed-engine benchmark runs end to end (a tiny model, one round); no figure is asserted."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_reports_every_schedule_and_microbatch_count(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS_distributed.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_distributed.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    for m in (2, 4, 8):
        for schedule in ("gpipe", "1f1b"):
            assert sum(r.startswith(f"| {m} | {schedule} |") for r in rows) == 1, rows
        assert sum(r.startswith(f"| {m} | ") and r.count("|") == 6 for r in rows) == 2, (
            rows
        )  # memory, 2 ranks
