"""The memory model's predictions against what a step allocates, on one GPU: per stage and the device.

GPT-2 small and the GPT-2 medium shape (``bench_gpu.py``'s models), in fp32 and ``bf16-mixed``,
4 stages x 4 chunks, every stage on the one GPU, SGD, modes never / except_last / always / always:1 /
selective. For each:

- **predicted**: the memory model (``pipeckpt.memory``) from a profile of one micro-batch on the GPU,
  taken under the step's autocast (``pipeckpt.memory.precision.forward_context``), as
  ``python -m pipeckpt.plan`` and ``checkpoint='auto'`` predict: each stage as if on a device of its
  own, and the one device holding every stage (``process_peak``);
- **measured per stage**: one training step of the local engine with every storage attributed to the
  stage that made it, stage inputs and incoming gradients copied in as between devices
  (``harness.stage_memory``, the figure the CPU table of docs/MEMORY.md compares with): one GPU
  cannot give each stage its own ``max_memory_allocated``;
- **measured, the device**: ``torch.cuda.max_memory_allocated`` over a step after a warm-up step,
  less what was allocated before it, plus the parameters (what the prediction counts): the
  allocator's own figure, against ``process_peak``.

Rows that fail (out of memory, say) are written as failed; the table is written after each plan, so
a run cut short keeps what it measured. Without CUDA it prints why and exits 0, unless
``--device cpu`` (the harness at ``--quick`` size, which ``tests/bench_smoke`` runs; the device
column is then the storage count of the whole step)::

    python benchmarks/bench_gpu_memory.py --out benchmarks/RESULTS_gpu_memory.md
    python benchmarks/bench_gpu_memory.py --quick --device cpu
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from bench_gpu import MEDIUM, QUICK, QUICK_CPU, SMALL, STAGES, Model, Shape
from harness.machine import machine
from harness.stage_memory import measure_device_step, measure_local_step, split_batch
from harness.tables import emit
from torch import Tensor, nn

from pipeckpt.memory.auto import process_peak
from pipeckpt.memory.precision import forward_context
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import profile
from pipeckpt.stages.partition import plan

CHUNKS = 4
MODES = ("never", "except_last", "always", "always:1", "selective")
PLANS = {
    "small-32": (SMALL, "32-true"),
    "small-bf16": (SMALL, "bf16-mixed"),
    "medium-32": (MEDIUM, "32-true"),
    "medium-bf16": (MEDIUM, "bf16-mixed"),
}


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def _model(shape: Shape, device: torch.device) -> Tuple[nn.Sequential, Tensor, Tensor]:
    layers = Model(shape, "plain").layers.to(device)  # bench_gpu.py's model, seed 0
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq_len + 1), generator=g).to(device)
    return layers, tokens[:, :-1], tokens[:, 1:]


def rows(shape: Shape, precision: str, device: torch.device, modes: Sequence[str]) -> List[str]:
    seq, x, y = _model(shape, device)
    context = lambda: forward_context(precision, device)  # noqa: E731
    with context():
        fitted = profile(seq, split_batch(x, CHUNKS), loss_fn=_loss, target=split_batch(y, CHUNKS), rounds=1)
    out: List[str] = []
    for mode in modes:
        try:
            stage_plan = plan(seq, devices=[device], stages=STAGES, checkpoint=mode, chunks=CHUNKS)
            predicted = predict(fitted, stage_plan, chunks=CHUNKS, optimizer="sgd")
            whole = process_peak(fitted, stage_plan, chunks=CHUNKS, optimizer="sgd")
            step = dict(chunks=CHUNKS, batch=x, loss_fn=lambda o: _loss(o, y), forward_context=context)
            measured, _ = measure_local_step(seq, stage_plan, **step)
            on_device = measure_device_step(seq, stage_plan, **step)
        except Exception as error:  # one mode out of memory must not cost the table
            out.append(
                f"| {mode} | failed: {type(error).__name__}: {str(error).splitlines()[0][:160]} | | | |"
            )
            seq.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        for s, m in zip(predicted.stages, measured):
            out.append(f"| {mode} | stage {s.stage} | {_mib(s.peak)} | {_mib(m)} | {_error(s.peak, m)} |")
        out.append(
            f"| {mode} | the device | {_mib(whole)} | {_mib(on_device)} | {_error(whole, on_device)} |"
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _error(predicted: int, measured: int) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f}" if measured > 0 else "n/a"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated: {', '.join(PLANS)}")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--quick", action="store_true", help="a tiny model: the harness only")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the harness only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_memory: no CUDA device here; nothing measured (run it on a GPU machine).")
        return 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.quick:
        shape = QUICK if device.type == "cuda" else QUICK_CPU
        plans = [(shape, "32-true"), (shape, "bf16-mixed")]
    else:
        plans = [PLANS[name] for name in args.plans.split(",")]
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    measured = "max_memory_allocated" if device.type == "cuda" else "storage count"
    lines = [
        "# Predicted against measured peak memory, 4 stages x 4 chunks on one device",
        "",
        f"Device: {where}. Host: {machine()}. SGD; MiB; error = (predicted - measured) / measured.",
        f"Per stage: storages attributed to each stage; the device: {measured}.",
        "",
    ]
    for shape, precision in plans:
        lines += [
            f"### {shape.name}, seq {shape.seq_len}, batch {shape.batch}, {precision}",
            "",
            "| mode | stage | predicted | measured | error % |",
            "|---|---|---|---|---|",
            *rows(shape, precision, device, args.modes.split(",")),
            "",
        ]
        emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
