"""A device preset's efficiency from a measured training step (issue 44: "calibrate that device's
preset from a measured step").

The cost model prices a step's compute as its FLOPs over ``peak x efficiency`` (docs/LAYOUT.md); the
presets' efficiency was fitted on published runs of other devices (the H100's on torchtitan's 8B).
This measures the step on the device itself: Hugging Face ``LlamaForCausalLM`` at Llama 3.2 1B's
shape (random weights from its config, nothing downloaded), trained by a real ``Trainer`` with
``PipelineStrategy`` (one stage, one chunk, the whole model on the one GPU) in ``bf16-mixed`` with
AdamW, CUDA-synchronised wall time of each step after two warm-up steps, the median. For each
checkpoint mode it prints:

- the cost model's step (``pipeckpt.layout.cost.estimate``) at the preset's efficiency, and the
  measured step beside it;
- the efficiency at which the model's step equals the measured one (bisection), the first mode's
  being the calibration: the later modes are predicted with it, a check of the recompute term;
- ``max_memory_allocated`` over the second step.

Without CUDA it prints why and exits 0, unless ``--device cpu`` (a tiny Llama, the harness end to end,
which the prepared run's dry mode runs)::

    python benchmarks/bench_gpu_calibrate.py --out $OUT/RESULTS_gpu_calibrate.md
    python benchmarks/bench_gpu_calibrate.py --device cpu --preset local_cpu_test --tiny
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import lightning as L
import torch
import transformers
from harness.efficiency import bisect_efficiency, with_efficiency
from harness.machine import machine
from torch import Tensor
from torch.utils.data import DataLoader

import pipeckpt
from pipeckpt.layout.candidates import Candidate
from pipeckpt.layout.cluster import Cluster, cluster
from pipeckpt.layout.cost import estimate
from pipeckpt.layout.model_costs import ModelCosts, model_costs_from_config

#: Llama 3.2 1B's config.json fields (tied embedding).
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
)  # fmt: skip
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
)  # fmt: skip
#: A CPU "device" for the dry run: its figures are not a machine's, only numbers to fit against.
CPU_TEST = dict(
    name="cpu (dry run)", nodes=1, devices_per_node=1, intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e9,
    latency_s=1e-5, device=dict(name="cpu", memory_bytes=2**34, peak_flops={"32-true": 1e11},
                                memory_bytes_per_s=1e10, efficiency=0.5),
)  # fmt: skip


class Llama(L.LightningModule):
    def __init__(self, config: transformers.LlamaConfig, device: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it trains: a 1B model's CPU init costs seconds
            self.model = transformers.LlamaForCausalLM(config)

    def configure_pipeline(self) -> Any:
        return pipeckpt.pipeline_of(self.model, "model.layers")

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


class Steps(L.Callback):
    """Wall time of every step after the second (CUDA-synchronised), and the second's peak."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.walls: List[float] = []
        self.peak = 0
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self._sync()
        if self.cuda and batch_idx == 1:
            torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self._sync()
        wall = time.perf_counter() - self._t0
        if self.cuda and batch_idx == 1:
            self.peak = torch.cuda.max_memory_allocated()
        if batch_idx > 1:
            self.walls.append(wall)


def measure(config: transformers.LlamaConfig, mode: str, args: argparse.Namespace) -> Steps:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch * args.steps, args.seq), generator=g)
    batches = [{"input_ids": ids[i : i + args.batch], "labels": ids[i : i + args.batch]}
               for i in range(0, len(ids), args.batch)]  # fmt: skip
    steps = Steps(args.device == "cuda")
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=1, precision=args.precision,
        max_steps=args.steps, callbacks=[steps], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tempfile.gettempdir(),  # a SIGTERM's checkpoint (its timeout) not in the checkout
        strategy=pipeckpt.PipelineStrategy(stages=1, chunks=1, checkpoint=mode),
    )  # fmt: skip
    trainer.fit(Llama(config, args.device), DataLoader(batches, batch_size=None))
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return steps


def predicted(costs: ModelCosts, mode: str, where: Cluster, args: argparse.Namespace) -> float:
    layout = Candidate(pp=1, tp=1, dp_replicate=1, dp_shard=1, schedule="gpipe", virtual_stages=1, chunks=1,
                       modes=(mode,))  # fmt: skip
    step = estimate(layout, costs, where, global_batch=args.batch, seq_len=args.seq, precision=args.precision)
    return step.step_s


def fitted(
    costs: ModelCosts, mode: str, where: Cluster, measured_s: float, args: argparse.Namespace
) -> float:
    """The efficiency at which the model's step equals ``measured_s``."""
    if predicted(costs, mode, with_efficiency(where, 1.0), args) > measured_s:
        return float("nan")  # slower than the model's step at full peak: nothing to fit
    return bisect_efficiency(
        lambda e: predicted(costs, mode, with_efficiency(where, e), args) > measured_s, low=1e-4
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--preset", default="h200_1", help="the cluster preset calibrated")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer Llama (the CPU dry run)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=7, help="steps a mode trains; the first two warm up")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--modes", default="never,always")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_calibrate: no CUDA device; nothing measured (use --device cpu for the dry run)")
        return 0
    where = cluster(CPU_TEST if args.preset == "local_cpu_test" else args.preset)
    config = transformers.LlamaConfig(**(TINY if args.tiny else LLAMA_1B), use_cache=False)
    costs = model_costs_from_config(config, seq_len=args.seq, precision=args.precision)
    shape = ", ".join(f"{k} {v}" for k, v in (TINY if args.tiny else LLAMA_1B).items())
    lines = [
        f"Machine: {machine()}; preset `{where.name}` ({where.device.name}), efficiency "
        f"{where.device.efficiency:g}. Model: HF LlamaForCausalLM ({shape}), sequence {args.seq}, batch "
        f"{args.batch}, {args.precision}, AdamW; one stage, one chunk. Median of {args.steps - 2} steps "
        f"after 2 warm-up steps. Command: `python benchmarks/bench_gpu_calibrate.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "| mode | measured ms | predicted ms (preset) | measured / predicted | efficiency fitted "
        "| predicted ms (calibrated) | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    calibrated: Optional[float] = None
    for mode in args.modes.split(","):
        try:
            steps = measure(config, mode, args)
            ms = statistics.median(steps.walls) * 1e3
            preset_ms = predicted(costs, mode, where, args) * 1e3
            eff = fitted(costs, mode, where, ms / 1e3, args)
            calibrated = eff if calibrated is None else calibrated
            cal_ms = predicted(costs, mode, with_efficiency(where, calibrated), args) * 1e3
            lines.append(f"| {mode} | {ms:.1f} | {preset_ms:.1f} | {ms / preset_ms:.3f} | {eff:.3f} "
                         f"| {cal_ms:.1f} | {steps.peak / 2**30:.2f} |")  # fmt: skip
        except Exception as e:  # a failing mode (out of memory, say) is a row, not the end of the table
            lines.append(f"| {mode} | failed: {type(e).__name__}: {str(e)[:120]} | | | | | |")
        print(lines[-1], flush=True)
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
    if calibrated is not None:
        lines.append(f"\nCalibrated efficiency (the first mode's): {calibrated:.3f}")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
