"""The GPU run's two memory tables on the CPU (``--device cpu``, tiny shapes): the plan's predictions
against each step's measured peaks, and ``checkpoint='auto'`` on HF GPT-2 against per-block
checkpointing under ``bf16-mixed``. Every row runs end to end; figures are asserted only where the
memory model is exact on the CPU."""

from pathlib import Path

from support.benchmarks import run_benchmark


def test_the_predictions_table_has_a_row_per_stage_and_the_device_for_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "gpu_memory.md"
    run_benchmark("bench_gpu_memory.py", "--quick", "--device", "cpu", "--out", str(out))
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows if row[0].strip() != "mode"]
    assert not [row for row in rows if row[1].startswith("failed")], rows
    for mode in ("never", "except_last", "always", "always:1", "selective"):
        wheres = [row[1] for row in rows if row[0] == mode]
        assert wheres == ["stage 0", "stage 1", "stage 2", "stage 3", "the device"] * 2  # fp32, bf16-mixed


def test_the_hf_auto_table_under_bf16_mixed_names_per_block_and_auto(tmp_path: Path) -> None:
    out = tmp_path / "gpu_auto.md"
    run_benchmark(
        "bench_hf_auto.py",
        *("--layers", "2", "--width", "64", "--heads", "2", "--seq", "32", "--batch", "4", "--vocab", "128"),
        *("--optimizer", "sgd", "--stages", "2", "--rounds", "1", "--precision", "bf16-mixed"),
        *("--out", str(out)),
    )
    text = out.read_text()
    assert "CPU, bf16-mixed;" in text
    assert [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")][1:] == [
        "per-block",
        "auto, 2 stages",
    ]
