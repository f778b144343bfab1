"""The two GPU tables, through Lightning: step time and peak memory on one GPU.

GPT-2 small (12 layers, d 768, vocab 8192), seq 1024, batch 8, in fp32 and
``bf16-mixed``; and the GPT-2 medium shape (24 layers, d 1024, 16 heads), seq 1024,
batch 16, ``bf16-mixed``. Every method trains the same model through a
``Trainer`` on one GPU, all pipeline stages on it (``placement=[0] * 4``):

- ``plain``: no pipeline; ``loop``: the training step runs the same 4 micro-batches one
  after the other and backpropagates their summed loss (micro-batching without a
  pipeline); ``per-block checkpoint``: ``torch.utils.checkpoint`` around every block;
- pipeckpt 4 stages x 1 chunk ``never`` and 4 x 4 ``never`` / ``always`` / ``offload``, and per
  layer ``always:1`` / ``offload:1``: the rows "offload vs always" compare each offload with the
  ``always`` of its granularity (time, and the CUDA bytes kept after forward);
- under the ``compile`` setting (``--methods compile``): 4 x 4 ``never`` and ``selective`` compiled
  (selective's SAC policy inside each layer's graph), and on a GPU ``never`` / ``always`` under
  ``compile='reduce-overhead'`` (CUDA graphs), against eager ``never``.

Timing: CUDA-synchronised wall time of each optimizer step (forward, loss, backward,
SGD step) after warm-up steps, methods interleaved over rounds (a fresh ``Trainer`` per
method per round), median per method. Peak: ``max_memory_allocated`` during the
measured steps minus what was allocated before the first step (weights), so it covers
activations, gradients and optimizer state. Kept after forward: ``memory_allocated`` when
backward is about to start (Lightning's ``on_before_backward``) minus the same base, median of
the measured steps: what forward left on the GPU for backward (saved activations, the loss's
logits, gradients of earlier steps). Without CUDA it prints why and exits 0, unless
``--device cpu``: the same harness on the CPU (times only, no memory columns; ``compile`` there
uses the ``aot_eager`` backend), which ``tests/bench_smoke`` runs at ``--quick`` size.

    python benchmarks/bench_gpu.py --out benchmarks/RESULTS_gpu.md
    python benchmarks/bench_gpu.py --methods offload   # plain and the offload/always rows only
    python benchmarks/bench_gpu.py --methods compile --plans small-bf16,medium-bf16
    python benchmarks/bench_gpu.py --quick --device cpu --methods compile   # the harness, in seconds
"""

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from harness.machine import machine
from harness.tables import emit
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy
from pipeckpt.app.models.gpt import gpt_layers

CHUNKS, STAGES = 4, 4


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    batch: int
    seq_len: int = 1024
    vocab_size: int = 8192


SMALL = Shape("GPT-2 small", 12, 768, 12, 8)
MEDIUM = Shape("GPT-2 medium shape", 24, 1024, 16, 16)
QUICK = Shape("tiny", 4, 128, 4, 8, seq_len=64, vocab_size=256)
QUICK_CPU = Shape("tiny, CPU", 2, 32, 2, 8, seq_len=16, vocab_size=64)  # compiles in seconds


class Model(L.LightningModule):
    def __init__(self, shape: Shape, style: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.style = style
        self.layers = gpt_layers(
            vocab_size=shape.vocab_size,
            d_model=shape.d_model,
            n_heads=shape.n_heads,
            n_layers=shape.n_layers,
            seq_len=shape.seq_len,
            dropout=0.0,
        )

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def _logits(self, x: Tensor) -> Tensor:
        if self.style != "per-block":
            return self.layers(x)
        for i, layer in enumerate(self.layers):
            between = 0 < i < len(self.layers) - 2  # the blocks
            x = checkpoint(layer, x, use_reentrant=False) if between else layer(x)
        return x

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        if self.style == "loop":
            pairs = zip(x.chunk(CHUNKS), y.chunk(CHUNKS))
            return sum(F.cross_entropy(self._logits(a).flatten(0, 1), b.flatten()) for a, b in pairs) / CHUNKS
        return F.cross_entropy(self._logits(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


CUDA = {"on": False}  # whether the run is on a GPU (main sets it): memory is read only there
COMPILE: Dict[str, Any] = {"value": True}  # the compile setting of the compiled rows (aot_eager on CPU)


def _sync() -> None:
    if CUDA["on"]:
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA["on"] else 0


class StepTimer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.base, self.peak = warmup, [], 0, 0
        self.kept: List[int] = []
        self._start = 0.0

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.warmup:
            _sync()
            self.kept.append(_allocated() - self.base)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        _sync()
        if trainer.global_step == 0:
            self.base = _allocated()
        if trainer.global_step == self.warmup and CUDA["on"]:
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        _sync()
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)
            self.peak = (torch.cuda.max_memory_allocated() if CUDA["on"] else 0) - self.base


def strategy(chunks: int, mode: str, compile: Any = False) -> PipelineStrategy:
    return PipelineStrategy(
        stages=STAGES, placement=[0] * STAGES, chunks=chunks, checkpoint=mode, compile=compile
    )


def compiled(mode: str) -> Callable[[], PipelineStrategy]:
    return lambda: strategy(CHUNKS, mode, COMPILE["value"])


def graphed(mode: str) -> Callable[[], PipelineStrategy]:
    return lambda: strategy(CHUNKS, mode, "reduce-overhead")


METHODS: Dict[str, Tuple[str, Callable[[], Any]]] = {
    "plain": ("plain", lambda: "auto"),
    "loop over 4 micro-batches": ("loop", lambda: "auto"),
    "per-block checkpoint": ("per-block", lambda: "auto"),
    "pipeckpt 4x1 never": ("plain", lambda: strategy(1, "never")),
    "pipeckpt 4x4 never": ("plain", lambda: strategy(CHUNKS, "never")),
    "pipeckpt 4x4 except_last": ("plain", lambda: strategy(CHUNKS, "except_last")),
    "pipeckpt 4x4 always": ("plain", lambda: strategy(CHUNKS, "always")),
    "pipeckpt 4x4 selective": ("plain", lambda: strategy(CHUNKS, "selective")),
    "pipeckpt 4x4 offload": ("plain", lambda: strategy(CHUNKS, "offload")),
    "pipeckpt 4x4 always:1": ("plain", lambda: strategy(CHUNKS, "always:1")),
    "pipeckpt 4x4 offload:1": ("plain", lambda: strategy(CHUNKS, "offload:1")),
    "pipeckpt 4x4 never, compiled": ("plain", compiled("never")),
    "pipeckpt 4x4 selective, compiled": ("plain", compiled("selective")),
    "pipeckpt 4x4 never, reduce-overhead": ("plain", graphed("never")),
    "pipeckpt 4x4 always, reduce-overhead": ("plain", graphed("always")),
}
# --methods compile: the compile rows against eager never and selective (reduce-overhead: GPU only).
COMPILE_METHODS = (
    ["plain"]
    + [
        f"pipeckpt 4x4 {m}"
        for m in ("never", "selective", "never, compiled", "selective, compiled", "never, reduce-overhead")
    ]
    + ["pipeckpt 4x4 always", "pipeckpt 4x4 always, reduce-overhead"]
)
# --methods offload: what the offload rows need, interleaved the same way.
OFFLOAD_METHODS = ["plain"] + [f"pipeckpt 4x4 {m}" for m in ("always", "offload", "always:1", "offload:1")]


def run_once(shape: Shape, method: str, precision: str, steps: int, warmup: int) -> StepTimer:
    style, make_strategy = METHODS[method]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (shape.batch * (steps + 1), shape.seq_len + 1), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=shape.batch)
    timer = StepTimer(warmup)
    trainer = L.Trainer(
        accelerator="gpu" if CUDA["on"] else "cpu",
        devices=1,
        strategy=make_strategy(),
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        default_root_dir=tempfile.gettempdir(),  # a run its timeout stops saves its SIGTERM checkpoint there
    )
    trainer.fit(Model(shape, style), data)
    return timer


def table(
    shape: Shape, precision: str, methods: Sequence[str], *, rounds: int, steps: int, warmup: int
) -> List[str]:
    times: Dict[str, List[float]] = {m: [] for m in methods}
    peaks: Dict[str, int] = {}
    kept: Dict[str, int] = {}
    failed: Dict[str, str] = {}
    for r in range(rounds):
        names = list(methods)
        for method in names[r % len(names) :] + names[: r % len(names)]:
            if method in failed:
                continue
            try:
                timer = run_once(shape, method, precision, steps, warmup)
            except Exception as error:  # one broken method must not cost the table
                failed[method] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                print(f"{method} failed: {failed[method]}", flush=True)
                _empty_cache()
                continue
            times[method].append(statistics.median(timer.times))
            peaks[method] = timer.peak
            kept[method] = int(statistics.median(timer.kept)) if timer.kept else -1
            _empty_cache()
    med = {m: statistics.median(v) for m, v in times.items() if v}
    plain = med["plain"]
    lines = [
        f"### {shape.name}, seq {shape.seq_len}, batch {shape.batch}, {precision}",
        "",
        "| method | time vs plain | ms | peak act+grad+opt GiB | kept after forward GiB |",
        "|---|---|---|---|---|",
    ]
    for m in methods:
        if m not in med:
            lines.append(f"| {m} | failed: {failed.get(m, 'not run')} | | | |")
            continue
        gib = f"{peaks[m] / 2**30:.2f} | {kept[m] / 2**30:.2f}"
        lines.append(f"| {m} | {med[m] / plain:.2f} | {med[m] * 1e3:.1f} | {gib} |")
    lines.append("")
    if {
        "loop over 4 micro-batches",
        "pipeckpt 4x1 never",
        "pipeckpt 4x4 never",
        "pipeckpt 4x4 always",
    } <= set(med):
        loop = med["loop over 4 micro-batches"]
        never4, always4 = med["pipeckpt 4x4 never"], med["pipeckpt 4x4 always"]
        # One forward ~ a third of a plain step (backward ~ 2x forward): loop + that.
        forward = plain / 3
        lines += [
            f"- 4x1 never / plain: {med['pipeckpt 4x1 never'] / plain:.2f} (target <= 1.05)",
            f"- 4x4 never / loop: {never4 / loop:.2f} (target <= 1.10)",
            f"- 4x4 always / (loop + plain/3 as one forward): {always4 / (loop + forward):.2f}"
            " (target <= 1.15)",
        ]
    lines += compile_rows(med)
    for suffix in ("", ":1"):
        always, offload = f"pipeckpt 4x4 always{suffix}", f"pipeckpt 4x4 offload{suffix}"
        if always in med and offload in med:
            lines.append(offload_row(suffix, med[offload] / med[always], kept[always], kept[offload]))
    return [*lines, ""]


def _empty_cache() -> None:
    if CUDA["on"]:
        torch.cuda.empty_cache()


def compile_rows(med: Dict[str, float]) -> List[str]:
    """The compile ratios: compiled selective against never (eager and compiled; the issue's
    target: selective's recompute and no host cost, so about always's), reduce-overhead against eager."""
    out = []
    pairs = [
        ("selective, compiled", "never", "compiled selective / eager never"),
        ("selective, compiled", "never, compiled", "compiled selective / compiled never"),
        ("selective", "never", "eager selective / eager never (SAC's host cost)"),
        ("never, reduce-overhead", "never", "never under reduce-overhead / eager never"),
        ("always, reduce-overhead", "always", "always under reduce-overhead / eager always"),
    ]
    for a, b, what in pairs:
        if f"pipeckpt 4x4 {a}" in med and f"pipeckpt 4x4 {b}" in med:
            out.append(f"- {what}: {med[f'pipeckpt 4x4 {a}'] / med[f'pipeckpt 4x4 {b}']:.2f}")
    return out


def offload_row(suffix: str, time_ratio: float, kept_always: int, kept_offload: int) -> str:
    """The "offload vs always" row: time, and the share of what ``always`` keeps on the GPU after
    forward that offload keeps off it (a lower bound on the share of the saved activations:
    the kept bytes also hold the loss's logits, which both keep)."""
    moved = (kept_always - kept_offload) / kept_always if kept_always > 0 else float("nan")
    return (
        f"- offload{suffix} vs always{suffix}: time {time_ratio:.3f} (target <= 1.03), "
        f"kept after forward {kept_always / 2**30:.2f} -> {kept_offload / 2**30:.2f} GiB "
        f"({moved:.0%} of always{suffix}'s moved off the GPU; target >= 50%)"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 round: the harness only")
    parser.add_argument(
        "--methods",
        choices=["all", "offload", "compile"],
        default="all",
        help="offload: plain and the offload rows only; compile: the compile rows",
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the harness only")
    parser.add_argument(
        "--plans",
        default="small-32,small-bf16,medium-bf16",
        help="comma-separated tables: small-32, small-bf16, medium-bf16",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured (run it on a GPU machine).")
        return 0
    CUDA["on"] = args.device == "cuda"
    COMPILE["value"] = True if CUDA["on"] else "aot_eager"  # inductor on CPU needs a C++ compiler
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.quick:
        plans = [(QUICK, "bf16-mixed") if CUDA["on"] else (QUICK_CPU, "32-true")]
        rounds, steps, warmup = 1, 3 if CUDA["on"] else 2, 1
    else:
        known = {
            "small-32": (SMALL, "32-true"),
            "small-bf16": (SMALL, "bf16-mixed"),
            "medium-bf16": (MEDIUM, "bf16-mixed"),
        }
        plans = [known[name] for name in args.plans.split(",")]
        rounds, steps, warmup = args.rounds, args.steps, args.warmup
    lines = [
        "# One-host engine on one GPU",
        "",
        f"Device: {torch.cuda.get_device_name(0) if CUDA['on'] else 'CPU'}. Host: {machine()}.",
        "",
    ]
    methods = {"all": list(METHODS), "offload": OFFLOAD_METHODS, "compile": COMPILE_METHODS}[args.methods]
    if not CUDA["on"]:  # CUDA graphs exist only there
        methods = [m for m in methods if "reduce-overhead" not in m]
    for shape, precision in plans:
        lines += table(shape, precision, methods, rounds=rounds, steps=steps, warmup=warmup)
        emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
