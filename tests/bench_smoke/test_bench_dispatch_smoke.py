"""The dispatch-proxy and GPU benchmarks run end to end (harness only; no figure is asserted)."""

from pathlib import Path

import pytest
import torch
from support.benchmarks import run_benchmark

RATIOS = [
    "never, 1 chunk / plain",
    "never / loop",
    "always / (loop + forward)",
    "torchgpipe never / loop",
]


run = run_benchmark


def test_quick_dispatch_run_writes_every_ratio_with_a_number(tmp_path: Path) -> None:
    out = tmp_path / "dispatch.md"
    run("bench_dispatch.py", "--quick", "--out", str(out))
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    for name in RATIOS:
        (row,) = [r for r in rows if r.startswith(f"| {name} |")]
        float(row.split("|")[2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it measures for minutes")
def test_gpu_benchmark_without_cuda_exits_cleanly_and_says_why(tmp_path: Path) -> None:
    done = run("bench_gpu.py", "--quick", "--out", str(tmp_path / "gpu.md"))
    assert "no CUDA device" in done.stdout
