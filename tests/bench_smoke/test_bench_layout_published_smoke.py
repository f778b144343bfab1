"""The cost model against published runs, on paper (``bench_layout_published.py``): each fit row
reads 1.00, and every row is predicted within issue 44's 25% of its published tokens/s per GPU
but torchtitan's interleaved 405B run, published with Float8, torch.compile and async TP, which the
model does not price (benchmarks/RESULTS_layout.md, "Published runs"). A change to the cost model
that moves a row out of the bar fails here, not in a results file read later."""

from typing import Dict

from support.benchmarks import run_benchmark

NOT_MET = {"Llama 3.1 405B, PP 8 x TP 8 x FSDP 8, interleaved 1F1B, full AC"}


def ratios() -> Dict[str, str]:
    """Each row's name and its "predicted / published" cell, as the script prints them."""
    out = run_benchmark("bench_layout_published.py").stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    return {
        cells[0].strip(): cells[5].strip() for cells in rows if len(cells) == 10 and cells[0].strip() != "run"
    }


def test_every_published_run_but_the_float8_interleaved_one_is_predicted_within_25_percent() -> None:
    found = ratios()
    assert len(found) == 10 and NOT_MET <= set(found)
    fits = {name: cell for name, cell in found.items() if cell.endswith("(fit)")}
    assert set(fits.values()) == {"1.00 (fit)"} and len(fits) == 2
    within = {name: float(cell.split()[0]) for name, cell in found.items() if name not in NOT_MET}
    assert all(0.75 <= r <= 1.25 for r in within.values()), within
