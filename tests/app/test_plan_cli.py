"""``python -m pipeckpt.plan``: composes the configs, profiles, prints a row per stage, draws the PNG."""

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from support import forkserver

from pipeckpt.plan import main

REPO = Path(__file__).resolve().parents[2]


def _plan(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return forkserver.run(
        [sys.executable, "-m", "pipeckpt.plan", *overrides],
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_the_plan_command_prints_one_row_per_stage_and_writes_the_png(tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    result = _plan(
        "model=mlp",
        "strategy.stages=3",
        "ckpt=always",
        "+memory.budget=1MiB",
        f"memory.png={png}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "layers", "mode"])
    rows = [line.split() for line in lines[header + 1 : header + 4]]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert all(row[2] == "always" and row[-1] == "fits" for row in rows)
    assert any(line.startswith("auto under 1.0 MiB: checkpoint=") for line in lines)
    assert not any(line.startswith("memory.fake:") for line in lines)  # it fits this machine: real
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_budget_is_a_configuration_error(tmp_path: Path) -> None:
    result = _plan("model=mlp", "+memory.budget=lots", cwd=tmp_path)
    assert result.returncode == 1
    assert "Configuration error: memory.budget='lots': is not a size" in result.stderr


def test_a_cluster_that_does_not_exist_is_a_configuration_error_listing_the_presets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["model=gpt", "strategy.engine=distributed", "strategy.layout=auto", "cluster=nosuch"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Configuration error: In 'train': Could not find 'cluster/nosuch'")
    assert "h100_8x8" in err and "Traceback" not in err


def test_a_value_of_the_wrong_type_is_a_configuration_error_saying_the_key_and_type(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["model=gpt", "strategy.sequence_parallel=maybe"]) == 1
    err = capsys.readouterr().err
    assert "Error merging override strategy.sequence_parallel=maybe" in err
    assert "Value 'maybe' is not a valid bool" in err and "full_key: strategy.sequence_parallel" in err


def test_the_plan_table_shows_the_memory_models_numbers_for_the_same_model_and_batch() -> None:
    import torch

    from pipeckpt.boundaries.contract import pipelined_sequential
    from pipeckpt.memory.predict import predict
    from pipeckpt.memory.profile import profile
    from pipeckpt.plan import COLUMNS, _loss, format_prediction, run
    from pipeckpt.stages.partition import plan

    torch.set_num_threads(1)
    overrides = ["model=mlp", "strategy.stages=3", "ckpt=always", "memory.optimizer=adam"]
    prediction, _, _ = run(overrides)
    # Independently: the same model (seed 0), batch and plan, through memory.py directly.
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from pipeckpt.plan import CONF, _batch

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    inputs, targets = _batch(cfg)
    torch.manual_seed(cfg.seed)
    seq = pipelined_sequential(instantiate(cfg.model))
    stage_plan = plan(seq, devices=[torch.device("cpu")], stages=3, checkpoint="always", chunks=4)
    chunks = cfg.strategy.chunks
    fitted = profile(seq, inputs.chunk(chunks)[0], loss_fn=_loss, target=targets.chunk(chunks)[0], rounds=1)
    expected = predict(fitted, stage_plan, chunks=chunks, optimizer="adam", schedule="local")
    for got, want in zip(prediction.stages, expected.stages, strict=True):
        assert [getattr(got, c) for c in (*COLUMNS, "peak")] == [getattr(want, c) for c in (*COLUMNS, "peak")]
    rows = [line.split() for line in format_prediction(prediction).splitlines()[2:5]]
    for row, want in zip(rows, expected.stages, strict=True):
        assert row[3:9] == [f"{getattr(want, c) / 2**20:.2f}" for c in COLUMNS]


def _rows(stdout: str) -> List[List[str]]:
    """The table's rows: stage, layers, mode and the memory columns through the peak (times left out)."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "layers", "mode"])
    return [line.split()[:10] for line in lines[header + 1 :] if line.split()[:1] in (["0"], ["1"])]


def test_a_model_over_the_memory_available_is_planned_on_fake_tensors_said_in_one_line(
    tmp_path: Path,
) -> None:
    # memory.available stands in for this machine's memory: 1 KiB, below the MLP's 215 KiB of weights.
    args = ("model=mlp", "strategy.stages=2", "ckpt=always")
    fake = _plan(*args, "memory.available=1KiB", cwd=tmp_path)
    real = _plan(*args, "memory.fake=false", cwd=tmp_path)
    assert fake.returncode == 0 and real.returncode == 0, fake.stderr + real.stderr
    said = [line for line in fake.stdout.splitlines() if line.startswith("memory.fake:")]
    assert said == [
        "memory.fake: building on fake tensors (times from FLOPs): the model's 215.0 KiB of parameters "
        "and buffers, their gradients and a 1.0 GiB margin need 1.0 GiB, more than the 1.0 KiB "
        "available (memory.fake=false builds it for real)"
    ]
    assert not any(line.startswith("memory.fake:") for line in real.stdout.splitlines())
    assert len(_rows(fake.stdout)) == 2 and _rows(fake.stdout) == _rows(real.stdout)  # the same MiB


def test_memory_fake_false_over_the_memory_available_is_a_configuration_error(tmp_path: Path) -> None:
    result = _plan("model=mlp", "memory.fake=false", "memory.available=1KiB", cwd=tmp_path)
    assert result.returncode == 1 and "stage" not in result.stdout
    assert (
        "Configuration error: memory.fake=false with a model of 215.0 KiB of parameters and buffers: "
        "a real build holds them all, and 1.0 KiB of memory is available. HINT: drop memory.fake=false"
    ) in result.stderr


def test_the_memory_available_is_linuxs_memavailable_as_psutil_reads_it() -> None:
    psutil = pytest.importorskip("psutil")
    from pipeckpt.memory.machine import available_memory

    ours, theirs = available_memory(), psutil.virtual_memory().available
    assert abs(ours - theirs) <= 0.05 * theirs  # read moments apart on a machine others load


def test_the_plan_under_bf16_mixed_is_profiled_under_lightnings_autocast() -> None:
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from lightning.pytorch.plugins.precision import MixedPrecision

    from pipeckpt.boundaries.contract import pipelined_sequential
    from pipeckpt.memory.predict import predict
    from pipeckpt.memory.profile import profile
    from pipeckpt.plan import CONF, _batch, _loss, run
    from pipeckpt.stages.partition import plan

    torch.set_num_threads(1)
    overrides = ["model=mlp", "strategy.stages=2", "ckpt=never", "memory.optimizer=sgd"]
    fp32, _, _ = run(overrides)
    bf16, _, _ = run([*overrides, "trainer.precision=bf16-mixed"])
    # Independently: the same model and batch profiled under the region a bf16-mixed Trainer opens.
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    inputs, targets = _batch(cfg)
    torch.manual_seed(cfg.seed)
    seq = pipelined_sequential(instantiate(cfg.model))
    chunks = cfg.strategy.chunks
    with MixedPrecision("bf16-mixed", "cpu").forward_context():
        fitted = profile(
            seq, inputs.chunk(chunks)[0], loss_fn=_loss, target=targets.chunk(chunks)[0], rounds=1
        )
    stage_plan = plan(seq, devices=[torch.device("cpu")], stages=2, checkpoint="never", chunks=chunks)
    expected = predict(fitted, stage_plan, chunks=chunks, optimizer="sgd", schedule="local")
    assert [s.activations for s in bf16.stages] == [s.activations for s in expected.stages]
    assert [s.peak for s in bf16.stages] == [s.peak for s in expected.stages]
    # Each micro-batch keeps its own bf16 casts of the weights for its backward: not fp32's figure.
    assert [s.activations for s in bf16.stages] != [s.activations for s in fp32.stages]
