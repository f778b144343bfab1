"""train.py end to end on CPU, as a user runs it: a process of its own (forked by
support.forkserver once the imports are done), outputs in tmp_path."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import forkserver

ROOT = Path(__file__).resolve().parents[2]
FAST = ["trainer=fast", "trainer.enable_progress_bar=false", "threads=1"]


def train(
    out: Path, *overrides: str, multirun: bool = False, check: bool = True
) -> subprocess.CompletedProcess:
    """Runs train.py with fast settings; its run directory (or sweep directory) is ``out``."""
    where = f"hydra.sweep.dir={out}" if multirun else f"hydra.run.dir={out}"
    command = [sys.executable, "train.py", *(["-m"] if multirun else []), *FAST, where, *overrides]
    # Outside any SLURM job, whatever the machine running the tests is in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = forkserver.run(command, cwd=ROOT, env=env, timeout=300)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def stages(out: Path) -> list[dict]:
    return json.loads((out / "stage_report.json").read_text())


def val_losses(stdout: str) -> tuple[float, float]:
    start = next(line for line in stdout.splitlines() if line.startswith("val_loss at start"))
    end = next(line for line in stdout.splitlines() if line.startswith("val_loss at end"))
    return float(start.split()[-1]), float(end.split()[-1])


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``python train.py`` with only the fast settings, shared by the tests that read it."""
    out = tmp_path_factory.mktemp("default")
    return out, train(out)


def test_default_run_trains_a_two_stage_except_last_pipeline(default_run):
    out, done = default_run
    start, end = val_losses(done.stdout)
    assert end < start
    assert [(s["mode"], s["recomputed"]) for s in stages(out)] == [("except_last", 3)] * 2


def test_default_run_prints_the_stage_table_and_a_summary_line(default_run):
    out, done = default_run
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    assert lines[header].split()[:2] == ["stage", "layers"]
    assert [line.split()[0] for line in lines[header + 2 : header + 4]] == ["0", "1"]
    assert lines[-1].startswith("[") and "4 steps" in lines[-1] and str(out) in lines[-1]


def test_default_run_leaves_checkpoint_logs_and_chart_in_the_run_dir(default_run):
    out, _ = default_run
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert (out / "logs" / "version_0" / "metrics.csv").is_file()
    assert (out / "stage_report.png").is_file()
    assert (out / ".hydra" / "config.yaml").is_file()


def test_ckpt_always_recomputes_every_microbatch(tmp_path):
    train(tmp_path, "ckpt=always", "validate=false")
    assert [(s["mode"], s["recomputed"]) for s in stages(tmp_path)] == [("always", 4)] * 2


def test_four_stages_of_eight_microbatches(tmp_path):
    train(tmp_path, "strategy.stages=4", "strategy.chunks=8", "validate=false")
    assert [s["recomputed"] for s in stages(tmp_path)] == [7] * 4


def test_ckpt_offload_runs_on_cpu(tmp_path):
    train(tmp_path, "ckpt=offload", "validate=false")
    assert [s["mode"] for s in stages(tmp_path)] == ["offload"] * 2


def test_a_mode_list_sets_each_stages_mode(tmp_path):
    train(tmp_path, "strategy.stages=4", "ckpt.modes=[always,always,except_last,never]", "validate=false")
    assert [s["mode"] for s in stages(tmp_path)] == ["always", "always", "except_last", "never"]


def test_validation_turned_off_in_lightnings_way_trains_without_validating(tmp_path):
    done = train(tmp_path, "model=mlp", "trainer.limit_val_batches=0")  # was an IndexError
    assert "val_loss at" not in done.stdout and not (tmp_path / "final.ckpt").exists()


def test_mlp_model(tmp_path):
    start, end = val_losses(train(tmp_path, "model=mlp").stdout)
    assert end < start


def test_convnet_with_deferred_batch_norm(tmp_path):
    start, end = val_losses(train(tmp_path, "model=convnet", "strategy.deferred_batch_norm=true").stdout)
    assert end < start


def test_single_strategy_reports_the_whole_model_as_one_stage(tmp_path):
    train(tmp_path, "strategy=single", "validate=false")
    assert [(s["first_layer"], s["last_layer"], s["mode"]) for s in stages(tmp_path)] == [(0, 6, "none")]


def test_max_steps_bounds_the_run(tmp_path):
    assert "3 steps" in train(tmp_path, "trainer.max_steps=3", "validate=false").stdout.splitlines()[-1]


@pytest.mark.slow
def test_bf16_autocast(tmp_path):
    start, end = val_losses(train(tmp_path, "trainer.precision=bf16-mixed").stdout)
    assert end < start


@pytest.mark.slow
def test_resume_from_a_checkpoint_continues_where_it_stopped(tmp_path):
    first = train(tmp_path / "first")
    resumed = train(
        tmp_path / "resumed",
        f"ckpt_path={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}",
        "trainer.max_steps=6",
    )
    # The resumed run starts from the first run's final weights and makes only the 2 missing steps.
    assert val_losses(resumed.stdout)[0] == val_losses(first.stdout)[1]
    assert "2 steps (from step 4 to 6)" in resumed.stdout.splitlines()[-1]


@pytest.mark.slow
def test_multirun_prints_one_summary_line_per_run(tmp_path):
    done = train(tmp_path, "ckpt=never,always", multirun=True)
    summaries = [line for line in done.stdout.splitlines() if line.startswith("[") and " steps in " in line]
    assert len(summaries) == 2
    assert "ckpt=never" in summaries[0] and "ckpt=always" in summaries[1]
    assert [s["mode"] for s in stages(tmp_path / "0")] == ["never"] * 2
    assert [s["mode"] for s in stages(tmp_path / "1")] == ["always"] * 2


def test_a_mode_list_of_the_wrong_length_exits_1_with_one_paragraph(tmp_path):
    done = train(tmp_path, "ckpt.modes=[always,never,never]", check=False)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr + done.stdout
    (message,) = [line for line in done.stderr.splitlines() if line.startswith("Configuration error")]
    assert "3 modes" in message and "2 stages" in message and "HINT" in message


def test_a_misspelled_override_exits_1_before_training(tmp_path):
    done = train(tmp_path, "strategy.chunk=8", check=False)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "chunk" in done.stderr and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_the_custom_module_example_learns(tmp_path):
    done = forkserver.run(
        [sys.executable, str(ROOT / "examples" / "custom_module.py")],
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("mean squared error"))
    before, after = (float(word) for word in re.findall(r"\d+\.\d+", line))
    assert after < before / 2
