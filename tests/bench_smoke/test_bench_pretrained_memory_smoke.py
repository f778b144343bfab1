"""The pretrained-memory benchmark runs end to end at its smoke size (a tiny Llama under pp4 beside
one eager ``from_pretrained``, a tiny Sequential under pp2 built on meta and eagerly) and writes its
table; no figure is asserted (at this size the fixed cost of a process outweighs what it holds)."""

from pathlib import Path

import pytest
from support.benchmarks import ROOT, run_benchmark


@pytest.mark.slow
def test_smoke_run_writes_a_row_per_rank_and_build(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS_pretrained_memory.md"
    run_benchmark("bench_pretrained_memory.py", "--smoke", "--out", str(out), env={"PYTHONPATH": str(ROOT)})
    rows = [line.strip("|").split("|") for line in out.read_text().splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0]]
    case, layout, build, rank = (header.index(c) for c in ("case", "layout", "build", "rank"))
    keys = sorted((r[case].strip(), r[layout].strip(), r[build].strip(), int(r[rank])) for r in rows[1:])
    expected = [("llama", "", "eager", 0), *(("llama", "pp4", "meta", r) for r in range(4))]
    expected += [("sequential", "", b, r) for b in ("eager", "meta") for r in range(2)]
    assert keys == sorted(expected), rows
    imports, peak = header.index("imports MiB"), header.index("peak (VmHWM) MiB")
    for r in rows[1:]:
        assert float(r[peak].replace(",", "")) > float(r[imports].replace(",", "")) > 0, (
            r
        )  # peak above imports
