"""What the per-stage timing report costs: a training step with StageReport's timing probe
against the same step without it, interleaved, as a ratio (median of rounds).

Two variants per round, each against the mean of the plain steps around it: ``probe`` (the
report as it is: pipeckpt's stages timed at their Stage module, whose backward is one autograd
node per micro-batch and segment) and ``probe, every node`` (the former report, still the path
for engines without Stage modules: hooks on every autograd node of each stage's graph). Timing
marks are a host clock on CPU and a CUDA event read once at the end of the step. The step is
the local engine's forward and backward of a GPT-shaped Sequential, with the engine built once::

    python benchmarks/bench_report.py                                  # CPU, small config
    python benchmarks/bench_report.py --device cuda --d-model 768 --layers 12 --seq 128 --batch 4
"""

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from harness.machine import machine

from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.report.probe import StageProbe
from pipeckpt.stages.partition import plan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--mode", default="except_last")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(args.device)
    seq = gpt_layers(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        seq_len=args.seq,
        dropout=0.1,
    ).to(device)
    stage_plan = plan(seq, devices=[device], stages=args.stages, checkpoint=args.mode, chunks=args.chunks)
    engine = LocalPipeline(seq, stage_plan, chunks=args.chunks, pin_memory=False)
    x = torch.randint(args.vocab, (args.batch, args.seq), device=device)
    y = torch.randint(args.vocab, (args.batch, args.seq), device=device)

    def step(probe: bool, stages: bool = True) -> Tuple[float, float, int]:
        """Wall seconds, process CPU seconds (steadier on a shared machine), hooks registered."""
        p = (
            StageProbe(
                seq,
                list(stage_plan.ranges),
                list(stage_plan.devices),
                memory=False,
                stages=engine.stages if stages else (),
                count_layers=not stages,
            )
            if probe
            else None
        )
        seq.zero_grad(set_to_none=True)
        _sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        out = engine.forward(x)
        F.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
        hooks = 0
        if p is not None:
            hooks = p.hooks
            p.remove()
            p.resolve()
        _sync(device)
        return time.perf_counter() - start, time.process_time() - cpu, hooks

    variants: Dict[str, Callable[[], Tuple[float, float, int]]] = {
        "probe": lambda: step(True),
        "probe, every node": lambda: step(True, stages=False),
    }
    for _ in range(2):  # warm-up
        step(False)
        for run in variants.values():
            run()
    walls: Dict[str, List[float]] = {name: [] for name in variants}
    cpus: Dict[str, List[float]] = {name: [] for name in variants}
    hooks: Dict[str, int] = {}
    plains: List[float] = []
    for _ in range(args.rounds):
        for name, run in variants.items():
            before = step(False)
            wall, cpu, hooks[name] = run()
            after = step(False)
            plains += [before[0], after[0]]
            walls[name].append(wall / ((before[0] + after[0]) / 2))
            cpus[name].append(cpu / ((before[1] + after[1]) / 2))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# report cost, {device_name}; {machine()}")
    print(
        f"GPT d {args.d_model} x {args.layers} layers, vocab {args.vocab}, seq {args.seq}, "
        f"batch {args.batch}, "
        f"{args.stages} stages x {args.chunks} chunks, {args.mode}; plain step median "
        f"{statistics.median(plains) * 1e3:.1f} ms; {args.rounds} interleaved rounds"
    )
    print("| variant | hooks per step | wall vs plain (median, min-max) | CPU vs plain (median, min-max) |")
    print("|---|---|---|---|")
    for name in variants:
        w, c = walls[name], cpus[name]
        print(
            f"| {name} | {hooks[name]} | {statistics.median(w):.4f} ({min(w):.3f}-{max(w):.3f}) "
            f"| {statistics.median(c):.4f} ({min(c):.3f}-{max(c):.3f}) |"
        )


if __name__ == "__main__":
    main()
