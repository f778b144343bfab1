"""The checkpoint benchmark runs end to end and reports every method.

Only the harness is checked here (a tiny model, one round); no figure is asserted.
"""

from pathlib import Path

from support.benchmarks import run_benchmark

METHODS = [
    "plain, no checkpointing",
    "micro-batches in a loop",
    "`torch.utils.checkpoint` per block",
    "torchgpipe never",
    "torchgpipe except_last",
    "torchgpipe always",
    "pipeckpt never",
    "pipeckpt except_last",
    "pipeckpt always",
    "pipeckpt offload",
    "pipeckpt mix",
]


def first_table(text: str) -> list:
    """The rows of the first Markdown table (the results), header included."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_quick_run_writes_a_row_per_method(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    run_benchmark("bench_checkpoint.py", "--quick", "--out", str(out))
    rows = first_table(out.read_text())
    for method in METHODS:
        matching = [r for r in rows if method in r]
        assert len(matching) == 1, f"{method!r} not reported once in:\n" + "\n".join(rows)
        cells = [c.strip() for c in matching[0].strip("|").split("|")]
        assert cells[2] != "n/m", f"no peak memory for {method!r}: {matching[0]}"
    assert "MISMATCH" not in out.read_text()
