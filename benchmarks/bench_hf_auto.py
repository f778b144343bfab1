"""``checkpoint='auto'`` on Hugging Face GPT-2 against per-block ``torch.utils.checkpoint``.

GPT-2 small's shape (12 blocks, d 768, 12 heads, GPT-2's vocabulary), random weights from its config,
sequence 128, batch 4, AdamW. The baseline is HF's own per-block checkpointing
(``gradient_checkpointing_enable``: each block under ``torch.utils.checkpoint``), trained by a plain
Trainer; its measured peak is the budget ``checkpoint='auto'`` plans the ``pipeline_of`` model to
(4 stages on the one CPU). Both train under real Trainers, side by side: the peak of a whole training
step (parameters, AdamW state, gradients, activations: every storage alive, counted by
``harness.live_bytes``, after a first step has made the optimizer's state) and the step's CPU
time, interleaved rounds, medians::

    python benchmarks/bench_hf_auto.py --rounds 3

Issue 36's activation-dominated shape (SGD: no optimizer state; plain training beside, and auto at 2
and 4 stages, each plan's predicted peak printed beside its measured one)::

    python benchmarks/bench_hf_auto.py --layers 8 --width 512 --heads 8 --seq 256 --batch 8 \
        --vocab 8192 --optimizer sgd --stages 2 4 --plain --rounds 3

The step time of auto's picks against per-block at that shape, and the same modes at other chunk
counts timed beside without planning (``--fixed MODES/BALANCE/CHUNKS``; results in
benchmarks/RESULTS_hf_auto_time.md, with the machine's load, ``os.getloadavg``, in the header)::

    python benchmarks/bench_hf_auto.py --layers 8 --width 512 --heads 8 --seq 256 --batch 8 \
        --vocab 8192 --optimizer sgd --stages 2 4 --rounds 5
    python benchmarks/bench_hf_auto.py --layers 8 --width 512 --heads 8 --seq 256 --batch 8 \
        --vocab 8192 --optimizer sgd --stages --fixed always,always/4,4/2 always,always/4,4/4 --rounds 4

Auto chooses the modes and the chunk count (``memory_search``; ``--search modes`` keeps
``--chunks``): the step's peak, at the optimizer's update, is the same for every method, and more
micro-batches add their own terms above it.

On a GPU (``--device cuda``; the prepared device run, scripts/gpu_check.sh): every stage on the one
GPU, the peak of the second step ``max_memory_allocated`` (everything allocated, parameters and the
optimizer's state included), times CUDA-synchronised wall times; ``--precision bf16-mixed`` at GPT-2's
sequence 1024 is the GPU table, written to ``--out`` as well::

    python benchmarks/bench_hf_auto.py --device cuda --precision bf16-mixed --seq 1024 --batch 8 \\
        --rounds 2 --out $OUT/RESULTS_gpu_auto.md
"""

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import lightning as L
import torch
import transformers
from harness.live_bytes import LiveBytes
from harness.machine import machine
from harness.tables import emit
from torch import Tensor
from torch.utils.data import DataLoader

import pipeckpt

STEPS = 5
#: The model and batch (set from the command line): GPT-2 small's shape, sequence 128, batch 4, AdamW.
SHAPE: Dict[str, Any] = dict(layers=12, width=768, heads=12, seq=128, batch=4, vocab=50257, optimizer="adamw")
#: Where and in which precision every method trains (set from the command line).
RUN: Dict[str, str] = dict(device="cpu", precision="32-true")


def _cuda() -> bool:
    return RUN["device"] == "cuda"


def gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        n_layer=SHAPE["layers"], n_embd=SHAPE["width"], n_head=SHAPE["heads"], n_positions=SHAPE["seq"],
        vocab_size=SHAPE["vocab"], use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class GPT2Module(L.LightningModule):
    def __init__(self, *, per_block: bool) -> None:
        super().__init__()
        self.model = gpt2()
        if per_block:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def configure_pipeline(self) -> Any:
        return pipeckpt.pipeline_of(self.model, "transformer.h")

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if SHAPE["optimizer"] == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-4)
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepProbe(L.Callback):
    """The CPU and wall time of every step after the second, and the peak of the second (``track``):
    the bytes alive at any moment of the step, parameters, gradients and the optimizer's state
    included (:class:`harness.live_bytes.LiveBytes`; torch's MemTracker keeps the inputs of
    selectively recomputed layers alive itself, see there)."""

    def __init__(self, *, track: bool) -> None:
        self.track = track
        self.times: List[float] = []
        self.walls: List[float] = []
        self.peak = 0
        self.peak_op = ""
        self._tracker: Optional[LiveBytes] = None
        self._t0 = self._w0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if _cuda():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif batch_idx == 1 and self.track:
            self._tracker = LiveBytes()
            self._tracker.count_step_state(pl_module, trainer.optimizers, batch)
            self._tracker.__enter__()
        self._t0, self._w0 = time.process_time(), time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if _cuda():
            torch.cuda.synchronize()
        took, wall = time.process_time() - self._t0, time.perf_counter() - self._w0
        if _cuda() and batch_idx == 1 and self.track:
            self.peak, self.peak_op = torch.cuda.max_memory_allocated(), "max_memory_allocated"
        elif self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.peak, self.peak_op = self._tracker.peak, self._tracker.peak_op
            self._tracker = None
        elif batch_idx > 1:
            self.times.append(took)
            self.walls.append(wall)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    batch = SHAPE["batch"]
    ids = torch.randint(0, SHAPE["vocab"], (batch * STEPS, SHAPE["seq"]), generator=g)
    batches = [
        {"input_ids": ids[i : i + batch], "labels": ids[i : i + batch]} for i in range(0, len(ids), batch)
    ]
    return DataLoader(batches, batch_size=None)


def fit(module: L.LightningModule, strategy: Any, *, track: bool = True) -> StepProbe:
    probe = StepProbe(track=track)
    trainer = L.Trainer(
        accelerator="gpu" if _cuda() else "cpu", devices=1, precision=RUN["precision"],
        max_steps=STEPS, callbacks=[probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tempfile.gettempdir(),  # a SIGTERM's checkpoint (its timeout) not in the checkout
        **({"strategy": strategy} if strategy is not None else {}),
    )  # fmt: skip
    trainer.fit(module, data())
    return probe


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="*", default=[4], help="one auto plan per count")
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument(
        "--search",
        default="modes,chunks",
        help="what auto may choose (memory_search): modes, chunks, balance",
    )
    parser.add_argument("--plain", action="store_true", help="plain training (no checkpointing) beside")
    parser.add_argument(
        "--fixed",
        nargs="*",
        default=[],
        help="plans timed beside without planning, MODES/BALANCE/CHUNKS each (always,always/4,4/2): "
        "auto's pick at another chunk count, say",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", default="32-true", help="the Trainer's, e.g. bf16-mixed")
    parser.add_argument("--out", type=Path, help="the table is written here too")
    for key, value in SHAPE.items():
        parser.add_argument(f"--{key}", type=type(value), default=value)
    args = parser.parse_args(argv)
    SHAPE.update({key: getattr(args, key) for key in SHAPE})
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_hf_auto: no CUDA device here; nothing measured (run it on a GPU machine).")
        return 0
    RUN.update(device=args.device, precision=args.precision)
    if not _cuda():
        torch.set_num_threads(1)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    base = fit(GPT2Module(per_block=True), None)
    log(f"per-block peak {base.peak} bytes at {base.peak_op}")
    peaks: Dict[str, int] = {"per-block": base.peak}
    times: Dict[str, List[float]] = {"per-block": list(base.times)}
    walls: Dict[str, List[float]] = {"per-block": list(base.walls)}
    loads = [os.getloadavg()[0]]  # the machine's load: other processes share its cores
    runs: Dict[str, Callable[[], StepProbe]] = {
        "per-block": lambda: fit(GPT2Module(per_block=True), None, track=False)
    }
    described: Dict[str, Tuple[str, int]] = {}
    if args.plain:
        first = fit(GPT2Module(per_block=False), None)
        log(f"plain peak {first.peak} bytes at {first.peak_op}")
        peaks["plain"], times["plain"], walls["plain"] = first.peak, list(first.times), list(first.walls)
        runs["plain"] = lambda: fit(GPT2Module(per_block=False), None, track=False)
    for stages in args.stages:
        auto = pipeckpt.PipelineStrategy(
            stages=stages,
            placement=_placement(stages),
            chunks=args.chunks,
            checkpoint="auto",
            memory_budget=base.peak,
            memory_search=args.search.split(","),
        )
        t0 = time.perf_counter()
        first = fit(GPT2Module(per_block=False), auto)
        plan = auto.auto_plan
        log(f"{plan.describe()} (planned in {time.perf_counter() - t0:.0f} s wall, fit included)")
        log(f"auto peak {first.peak} bytes at {first.peak_op}")
        key = f"auto, {stages} stages"
        peaks[key], times[key], walls[key] = first.peak, list(first.times), list(first.walls)
        described[key] = (plan.describe(), plan.choice.process_peak or plan.choice.prediction.peak)
        chosen = plan.settings
        settings = dict(balance=chosen.balance, chunks=chosen.chunks, checkpoint=chosen.checkpoint)
        runs[key] = functools.partial(_fit_plan, settings)
    for spec in args.fixed:
        modes, balance, chunks = spec.split("/")
        settings = dict(
            balance=[int(n) for n in balance.split(",")], chunks=int(chunks), checkpoint=modes.split(",")
        )
        first = fit(GPT2Module(per_block=False), _pipe(settings))
        key = f"{modes} / {balance} / chunks {chunks}"
        log(f"{key} peak {first.peak} bytes at {first.peak_op}")
        peaks[key], times[key], walls[key] = first.peak, list(first.times), list(first.walls)
        runs[key] = functools.partial(_fit_plan, settings)
    for r in range(args.rounds - 1):  # the later rounds: times only
        for key in list(runs) if r % 2 == 0 else list(reversed(runs)):
            probe = runs[key]()
            times[key].extend(probe.times)
            walls[key].extend(probe.walls)
        loads.append(os.getloadavg()[0])
        log(f"round {r + 2}: {times}")
    rounds = f"{args.rounds} interleaved rounds of {STEPS - 2} timed step(s)"
    load = f"1-minute load average {min(loads):.1f}-{max(loads):.1f} over the rounds"
    where = torch.cuda.get_device_name(0) if _cuda() else "CPU"
    lines = [f"{where}, {RUN['precision']}; host {machine()}; {load}; {rounds}, CPU and wall time, "
             f"medians [range]; shape {SHAPE}", ""]  # fmt: skip
    for key, (text, _) in described.items():
        lines += [f"{key}: {text}", ""]
    lines.append(
        "| method | predicted peak MiB | measured peak MiB (whole step) | peak vs per-block (the budget) "
        "| step CPU s | CPU time vs per-block [range] | step wall s | wall time vs per-block [range] |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    b_peak = peaks["per-block"]
    for key in runs:
        ratios = [a / b for a, b in zip(times[key], times["per-block"])]  # step by step, round by round
        wall_ratios = [a / b for a, b in zip(walls[key], walls["per-block"])]
        predicted = (
            f"{described[key][1] / 2**20:.1f} ({described[key][1]} bytes)" if key in described else "-"
        )
        lines.append(
            f"| {key} | {predicted} | {peaks[key] / 2**20:.1f} ({peaks[key]} bytes) | "
            f"{peaks[key] / b_peak:.3f} | "
            f"{statistics.median(times[key]):.2f} | {statistics.median(ratios):.2f} "
            f"[{min(ratios):.2f}-{max(ratios):.2f}] | {statistics.median(walls[key]):.2f} | "
            f"{statistics.median(wall_ratios):.2f} [{min(wall_ratios):.2f}-{max(wall_ratios):.2f}] |"
        )
    emit(lines, args.out)
    return 0


def _fit_plan(settings: Dict[str, Any]) -> StepProbe:
    return fit(GPT2Module(per_block=False), _pipe(settings), track=False)


def _placement(stages: int) -> Optional[List[int]]:
    """Every stage on the one GPU; on the CPU, the strategy's own placement."""
    return [0] * stages if _cuda() else None


def _pipe(settings: Dict[str, Any]) -> pipeckpt.PipelineStrategy:
    return pipeckpt.PipelineStrategy(stages=None, placement=_placement(len(settings["balance"])), **settings)


if __name__ == "__main__":
    sys.exit(main())
