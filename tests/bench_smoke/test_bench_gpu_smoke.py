"""The GPU benchmark's harness on the CPU (``--device cpu --quick``): every part the prepared device
run (scripts/gpu_check.sh) measures runs end to end and writes its table; no figure is asserted."""

from pathlib import Path

from support.benchmarks import run_benchmark


def test_the_compile_rows_run_on_cpu_and_write_their_table_and_ratios(tmp_path: Path) -> None:
    out = tmp_path / "gpu_compile.md"
    run_benchmark("bench_gpu.py", "--quick", "--device", "cpu", "--methods", "compile", "--out", str(out))
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| pipeckpt")]
    assert [r.split("|")[1].strip() for r in rows] == [
        "pipeckpt 4x4 never",
        "pipeckpt 4x4 selective",
        "pipeckpt 4x4 never, compiled",
        "pipeckpt 4x4 selective, compiled",
        "pipeckpt 4x4 always",
    ]
    assert not any("failed" in r for r in rows), rows
    for ratio in ("compiled selective / eager never", "compiled selective / compiled never"):
        (line,) = [x for x in text.splitlines() if x.startswith(f"- {ratio}: ")]
        float(line.rsplit(" ", 1)[1])


def test_the_offload_rows_run_on_cpu_with_the_moved_share(tmp_path: Path) -> None:
    out = tmp_path / "gpu_offload.md"
    run_benchmark("bench_gpu.py", "--quick", "--device", "cpu", "--methods", "offload", "--out", str(out))
    text = out.read_text()
    assert "- offload vs always: time" in text and "- offload:1 vs always:1: time" in text
