"""StageReport: per-stage time and activation memory measured in real training steps."""

import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch
from support.trainers import QUIET

from pipeckpt import PipelineStrategy
from pipeckpt.app.data import SyntheticTokens
from pipeckpt.app.models import GPT
from pipeckpt.report.render import format_table
from pipeckpt.report.stage_report import StageReport
from pipeckpt.sizes import human as human_bytes

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
        devices=1,
        max_steps=steps,
        **QUIET,
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
    stages = model.trainer.strategy.stages
    assert stages and all(not s._forward_hooks and not s._forward_pre_hooks for s in stages)


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


# -- figures against an independent count -------------------------------------------------------
# A designed model: two stages of [Sleep, Linear, Linear], bias-free Linears on 2-D inputs, fp32,
# batch 8 in 4 micro-batches of 2 rows. Each Linear allocates exactly its output (one mm), so
# the bytes a stage's forward allocates are known in closed form.

WIDTHS = (8, 64, 16, 32, 4)  # stage 0: 8 -> 64 -> 16, stage 1: 16 -> 32 -> 4
ROWS = 8 // CHUNKS  # rows per micro-batch


def out_bytes(width: int) -> int:
    return ROWS * width * 4  # one fp32 Linear output of one micro-batch


class Sleep(torch.nn.Module):
    """Identity that sleeps a known time: a deliberately slow layer."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return x


class Designed(L.LightningModule):
    def __init__(self, *, sleeps: tuple[float, float] = (0.0, 0.0)) -> None:
        super().__init__()
        torch.manual_seed(0)
        lin = [torch.nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(WIDTHS)]
        self.layers = torch.nn.Sequential(Sleep(sleeps[0]), lin[0], lin[1], Sleep(sleeps[1]), lin[2], lin[3])

    def configure_pipeline(self) -> torch.nn.Sequential:
        return self.layers

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


LAST_LAYERS = (2, 5)  # each stage's last layer in Designed.layers: a Linear, rerun in every recompute


class RerunCount(L.Callback):
    """Counts, per measured step, the calls of each stage's last layer made during backward
    (between Lightning's on_before_backward and on_after_backward): recomputes, counted
    without torchgpipe's is_recomputing flag that the report reads. The last layer, because
    under a per-layer mode the first (a parameter-free Sleep, whose input in stage 0 needs no
    gradient, and which saves nothing for selective checkpointing to rerun) may not rerun."""

    def __init__(self, layers: torch.nn.Sequential) -> None:
        self.forward_calls: list[list[int]] = []
        self.backward_calls: list[list[int]] = []
        self._in_backward = False
        self._now = [0, 0]
        self._now_backward = [0, 0]
        for stage, index in enumerate(LAST_LAYERS):
            layers[index].register_forward_pre_hook(self._count(stage))

    def _count(self, stage: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            (self._now_backward if self._in_backward else self._now)[stage] += 1

        return hook

    def on_train_batch_start(self, *args: Any) -> None:
        self._now, self._now_backward = [0, 0], [0, 0]

    def on_before_backward(self, *args: Any) -> None:
        self._in_backward = True

    def on_after_backward(self, *args: Any) -> None:
        self._in_backward = False

    def on_train_batch_end(self, *args: Any) -> None:
        self.forward_calls.append(self._now)
        self.backward_calls.append(self._now_backward)


def fit_designed(
    out: Path, mode: Any, *, sleeps: tuple[float, float] = (0.0, 0.0)
) -> tuple[StageReport, Any, Any]:
    model = Designed(sleeps=sleeps)
    report = StageReport(warmup_steps=1, steps=3, verbose=False, dirpath=str(out))
    clock, reruns = WallClock(), RerunCount(model.layers)
    trainer = L.Trainer(
        strategy=PipelineStrategy(stages=2, chunks=CHUNKS, balance=[3, 3], checkpoint=mode),
        devices=1,
        max_steps=4,  # step 0 warm-up, 1 memory probe, 2 and 3 timed
        **QUIET,
        default_root_dir=str(out),
        callbacks=[report, clock, reruns],
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)), batch_size=8)
    trainer.fit(model, data)
    return report, clock, reruns


@pytest.fixture(scope="module")
def designed(tmp_path_factory) -> Callable[..., tuple[StageReport, Any, Any]]:
    runs: dict[Any, tuple[StageReport, Any, Any]] = {}

    def get(mode: str, sleeps: tuple[float, float] = (0.0, 0.0)) -> tuple[StageReport, Any, Any]:
        if (mode, sleeps) not in runs:
            runs[mode, sleeps] = fit_designed(tmp_path_factory.mktemp("designed"), mode, sleeps=sleeps)
        return runs[mode, sleeps]

    return get


def test_never_peak_is_every_layer_output_of_every_micro_batch(designed):
    # never keeps each Linear's output (the next Linear's saved input, or the stage's output)
    # for every micro-batch until backward: chunks x the sum of the stage's outputs, exactly.
    stats = designed("never")[0].stats
    assert [s.peak_activation_bytes for s in stats] == [
        CHUNKS * (out_bytes(64) + out_bytes(16)),  # 2560
        CHUNKS * (out_bytes(32) + out_bytes(4)),  # 1152
    ]


def test_always_peak_is_the_held_outputs_plus_one_micro_batchs_run(designed):
    stats = designed("always")[0].stats
    # Last stage: its forward, without grad, frees each Linear output once the next one is
    # made; the outputs of earlier micro-batches wait for the loss. At the last micro-batch's
    # second Linear: chunks outputs + the first Linear's output, exactly (its backward,
    # one micro-batch's recompute after the loss freed the outputs, holds less: 32 + 4 widths).
    assert stats[1].peak_activation_bytes == CHUNKS * out_bytes(4) + out_bytes(32)  # 384
    # First stage: the same forward peak, chunks x 16-wide + one 64-wide output, exactly. Its
    # recompute in backward runs once the next stage has let go of that micro-batch's output
    # (the probe keeps no autograd node, so it keeps no saved tensor alive).
    assert stats[0].peak_activation_bytes == CHUNKS * out_bytes(16) + out_bytes(64)  # 1024


def test_a_per_layer_mode_keeps_every_layers_input_so_its_peak_is_nevers(designed):
    # always:1 checkpoints each layer alone: each keeps its input, i.e. the previous Linear's
    # output, for every micro-batch; the stage's output is the next stage's saved input.
    assert [s.peak_activation_bytes for s in designed("always:1")[0].stats] == [
        s.peak_activation_bytes for s in designed("never")[0].stats
    ]


@pytest.mark.parametrize(
    "mode,recomputed",
    [
        ("never", 0),
        ("except_last", CHUNKS - 1),
        ("always", CHUNKS),
        ("offload", CHUNKS),  # on CPU offload keeps the inputs where they are and recomputes as always
        ("selective", CHUNKS),  # = always+selective: the whole stage reruns, matmuls come from the cache
        ("except_last+selective", CHUNKS - 1),
        ("always:2", CHUNKS),  # segments [Sleep, Linear] and [Linear]: the first reruns once a micro-batch
        ("always:1", CHUNKS),  # stage 0's Sleep (no parameters, input needs no gradient) never reruns
        ("selective:1", CHUNKS),
    ],
)
def test_recomputed_is_the_modes_count_and_the_last_layers_backward_calls(designed, mode, recomputed):
    report, _, reruns = designed(mode)
    assert [s.recomputed for s in report.stats] == [recomputed, recomputed]
    # Independently: each timed step (2 and 3) runs each stage's last layer once per
    # micro-batch in forward and once per recomputed micro-batch during backward.
    assert reruns.forward_calls[2:] == [[CHUNKS, CHUNKS]] * 2
    assert reruns.backward_calls[2:] == [[recomputed, recomputed]] * 2


SLEEP = 0.02  # seconds, per micro-batch


@pytest.mark.parametrize("slow", [0, 1])
def test_a_slow_layer_shows_in_its_own_stages_times_only(designed, slow):
    # Stage 0 recomputes (always), stage 1 does not (never): the slow layer's sleep counts
    # in its stage's forward, and again in backward only in the recomputing stage.
    sleeps = (SLEEP, 0.0) if slow == 0 else (0.0, SLEEP)
    report, clock, _ = designed(("always", "never"), sleeps)
    stats, other = report.stats[slow], report.stats[1 - slow]
    slept = SLEEP * CHUNKS
    assert stats.forward_s >= slept
    assert other.forward_s < slept and other.backward_s < slept
    if slow == 0:
        assert stats.backward_s >= slept
    else:
        assert stats.backward_s < slept
    # Every figure lies inside the step that the test timed itself (the mean of the timed steps).
    wall = sum(clock.seconds[2:4]) / 2
    for s in report.stats:
        assert s.forward_s <= wall and s.backward_s <= wall, (s, wall)
    assert sum(s.forward_s + s.backward_s for s in report.stats) <= wall


@pytest.mark.parametrize("mode", ["never", "except_last", "always", "always:1", "selective:1", "selective"])
def test_every_stage_has_backward_time_in_every_mode(designed, mode):
    # Both stages have parameters, so both run a backward in every mode (stage 0 under
    # always:1 too, though its first layer neither trains nor reruns).
    stats = designed(mode)[0].stats
    assert all(s.forward_s > 0 and s.backward_s > 0 for s in stats), stats


def test_a_per_layer_recompute_of_a_slow_layer_shows_in_its_stages_backward(designed):
    # Stage 1 under always:1: its Sleep is a segment of its own, rerun in backward (its input
    # needs a gradient), so the sleep counts in stage 1's backward; stage 0 (never) sleeps nowhere.
    report, clock, _ = designed(("never", "always:1"), (0.0, SLEEP))
    slept = SLEEP * CHUNKS
    assert report.stats[1].forward_s >= slept and report.stats[1].backward_s >= slept
    assert report.stats[0].forward_s < slept and report.stats[0].backward_s < slept
    wall = sum(clock.seconds[2:4]) / 2
    assert sum(s.forward_s + s.backward_s for s in report.stats) <= wall


@pytest.mark.parametrize("mode", ["always", "always:1", "selective:1"])
@pytest.mark.parametrize("boundary", ["stage modules, own counts", "stage modules, layer counts", "layers"])
def test_the_probe_counts_and_times_recomputes_with_or_without_stage_modules(mode, boundary):
    # The report times pipeckpt's stages at their Stage module; an engine without one is timed
    # from the layers. Recomputes are counted by the Stage modules themselves or by every layer.
    # Every way, both stages rerun once per micro-batch and spend backward time.
    from pipeckpt.engines.local.pipeline import LocalPipeline
    from pipeckpt.report.probe import StageProbe
    from pipeckpt.stages.partition import plan

    layers = Designed().layers
    stage_plan = plan(layers, devices=[torch.device("cpu")], checkpoint=mode, chunks=CHUNKS, balance=[3, 3])
    engine = LocalPipeline(layers, stage_plan, chunks=CHUNKS, pin_memory=False)
    stages = engine.stages if boundary.startswith("stage modules") else ()
    own = boundary == "stage modules, own counts"
    ranges, devices = list(stage_plan.ranges), list(stage_plan.devices)
    probe = StageProbe(layers, ranges, devices, memory=False, stages=stages, count_layers=not own)
    engine.forward(torch.randn(8, 8)).pow(2).mean().backward()
    probe.remove()
    probe.resolve()
    assert probe.recomputed == {0: CHUNKS, 1: CHUNKS}
    assert all(probe.forward_s[s] > 0 and probe.backward_s[s] > 0 for s in (0, 1)), probe.backward_s
