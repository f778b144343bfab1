"""The GPU benchmark's harness on the CPU (``--device cpu --quick``): every part the prepared device
run (scripts/gpu_check.sh) measures runs end to end and writes its table; no figure is asserted."""

import os
from pathlib import Path

from support import forkserver
from support.benchmarks import ROOT, run_benchmark


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


def test_the_prepared_gpu_run_runs_every_part_on_the_cpu_and_writes_each_table(tmp_path: Path) -> None:
    # GPU_CHECK_DRY: scripts/gpu_check.sh with every part at its CPU size, so a flag or path the
    # device run would trip on fails here, not in its few minutes on a GPU.
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(tmp_path)}
    done = forkserver.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "skipped" in (tmp_path / "test_cuda.log").read_text()
    for name in ("compile", "offload", "memory", "auto", "calibrate", ""):
        table = (tmp_path / f"RESULTS_gpu{'_' + name if name else ''}.md").read_text()
        rows = [line for line in table.splitlines() if line.startswith("| ")]
        assert len(rows) >= 3 and not [r for r in rows if "failed" in r], (name, rows)


def test_the_prepared_gpu_run_runs_only_the_parts_it_is_given(tmp_path: Path) -> None:
    # GPU_CHECK_PARTS: the device's minutes for the parts not measured before, the others skipped.
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(tmp_path), "GPU_CHECK_PARTS": "calibration"}
    done = forkserver.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["RESULTS_gpu_calibrate.md"]
    assert done.stdout.count("skipped (GPU_CHECK_PARTS)") == 6
