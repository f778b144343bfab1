"""The frontier benchmark runs end to end on a subset (harness only; no figure is asserted)."""

from pathlib import Path

from support.benchmarks import ROOT, run_benchmark


def test_a_quick_subset_writes_each_peer_with_both_auto_picks_and_the_png(tmp_path: Path) -> None:
    out = tmp_path / "frontier.md"
    args = ["--quick", "--rounds", "1", "--repeat", "1", "--profile-rounds", "1", "--out", str(out)]
    subset = ["--only", "per-block,ckpt-seq-4,always-c1"]
    run_benchmark("bench_frontier.py", *args, *subset, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    for peer in ("`torch.utils.checkpoint` per block", "`checkpoint_sequential`, 4 segments"):
        (row,) = [r for r in rows if r.startswith(f"| {peer}")]
        assert row.count("at or below") + row.count("not below") + row.count("no plan fits") == 2, row
    assert any(r.startswith("| pipeckpt always, 1 chunks |") for r in rows)
    assert out.with_suffix(".png").stat().st_size > 0
