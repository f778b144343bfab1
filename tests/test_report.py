"""StageReport: per-stage time and activation memory measured in real training steps."""

import json
import time
from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch

from pipeckpt import PipelineStrategy
from pipeckpt.data import SyntheticTokens
from pipeckpt.models import GPT
from pipeckpt.report import StageReport, format_table, human_bytes

CHUNKS = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: several OpenMP teams (main and pipeline threads) on a
    busy machine slow each other down by an order of magnitude."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class WallClock(L.Callback):
    """Times each training batch from outside the report: an independent figure to bound it by."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def fit(out: Path, strategy: Any, steps: int = 3) -> tuple[StageReport, GPT]:
    L.seed_everything(0)
    callback = StageReport(warmup_steps=1, steps=2, dirpath=str(out), verbose=False)
    clock = WallClock()
    callback.clock = clock  # type: ignore[attr-defined]
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[callback, clock],
    )
    model = GPT(size="tiny", n_layers=2, seq_len=32, dropout=0.1)
    trainer.fit(model, SyntheticTokens(seq_len=32, num_samples=64, val_samples=16, batch_size=8))
    return callback, model


def pipe(mode) -> PipelineStrategy:
    return PipelineStrategy(stages=2, chunks=CHUNKS, checkpoint=mode)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Callable[[str], tuple[StageReport, GPT, Path]]:
    """One fit per mode for the whole module; the fits are the slow part."""
    runs: dict[str, tuple[StageReport, GPT, Path]] = {}

    def get(mode: str) -> tuple[StageReport, GPT, Path]:
        if mode not in runs:
            out = tmp_path_factory.mktemp(mode)
            runs[mode] = (*fit(out, "auto" if mode == "single" else pipe(mode)), out)
        return runs[mode]

    return get


@pytest.mark.parametrize("mode,recomputed", [("never", 0), ("except_last", CHUNKS - 1), ("always", CHUNKS)])
def test_recomputed_microbatches_follow_the_mode(measured, mode, recomputed):
    stats = measured(mode)[0].stats
    assert [s.recomputed for s in stats] == [recomputed, recomputed]
    assert [s.mode for s in stats] == [mode, mode]


def test_checkpointing_every_stage_lowers_each_stages_peak_activations(measured):
    never = measured("never")[0].stats
    always = measured("always")[0].stats
    for a, n in zip(always, never):
        assert a.peak_activation_bytes < n.peak_activation_bytes / 2


def test_a_mode_list_checkpoints_only_the_stages_it_names(tmp_path):
    stats = fit(tmp_path, pipe(["always", "never"]))[0].stats
    assert [s.recomputed for s in stats] == [CHUNKS, 0]


def test_stages_cover_the_layers_and_their_parameters(measured):
    callback, model, _ = measured("except_last")
    assert [(s.first_layer, s.last_layer) for s in callback.stats] == [(0, 1), (2, 4)]
    assert sum(s.params for s in callback.stats) == sum(p.numel() for p in model.layers.parameters())


def test_times_are_positive_and_stage_shares_fit_in_the_step(measured):
    stats = measured("always")[0].stats
    assert all(s.forward_s > 0 and s.backward_s > 0 for s in stats)
    assert 0 < sum(s.step_share for s in stats) <= 1


def test_stage_times_fit_inside_the_independently_timed_steps(measured):
    callback = measured("always")[0]
    # Steps 2 and 3 are timed (warm-up 1, first measured step probes memory); the report's
    # per-stage forward and backward run inside them, on one thread, so they cannot sum to more.
    wall = sum(callback.clock.seconds[2:3]) if len(callback.clock.seconds) > 2 else callback.clock.seconds[-1]
    reported = sum(s.forward_s + s.backward_s for s in callback.stats)
    assert 0.2 * wall < reported <= wall, (reported, wall)


def test_without_a_pipeline_the_whole_model_is_one_stage(measured):
    (stage,) = measured("single")[0].stats
    assert (stage.first_layer, stage.last_layer, stage.mode) == (0, 4, "none")
    assert stage.peak_activation_bytes > 0


def test_writes_a_chart_and_the_numbers(measured):
    callback, _, out = measured("except_last")
    assert (out / "stage_report.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / "stage_report.json").read_text())
    assert [row["peak_activation_bytes"] for row in saved] == [
        s.peak_activation_bytes for s in callback.stats
    ]


def test_a_run_shorter_than_the_warm_up_is_still_measured(tmp_path):
    assert len(fit(tmp_path, pipe("never"), steps=1)[0].stats) == 2


def test_the_probe_leaves_no_hook_behind(measured):
    callback, model, _ = measured("always")
    assert callback.stats and torch._C._len_torch_dispatch_stack() == 0
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in model.layers)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_table_has_a_header_and_one_row_per_stage(measured):
    table = format_table(measured("never")[0].stats)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["stage", "layers", "params"]
    assert len(lines) == 2 + 2


@pytest.mark.parametrize(
    "nbytes,text", [(512, "512 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"), (5 * 2**30, "5.0 GiB")]
)
def test_human_bytes(nbytes, text):
    assert human_bytes(nbytes) == text
