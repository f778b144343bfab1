"""What the per-stage timing report costs: a training step with StageReport's timing probe
against the same step without it, interleaved, as a ratio (median of rounds).

Three variants per round, each against the mean of the plain steps around it:
``probe`` (the report as it is: a host clock on CPU, a CUDA event per autograd node read once at
the end of the step) and ``probe+sync`` (the former report: the device synchronised at every
node, kept here for comparison only). The step is the local engine's forward and backward of a
GPT-shaped Sequential, with the engine built once::

    python benchmarks/bench_report.py                                  # CPU, small config
    python benchmarks/bench_report.py --device cuda --d-model 768 --layers 12 --seq 128 --batch 4
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine

from pipeckpt import report
from pipeckpt.engines.local_pipeline import LocalPipeline
from pipeckpt.models.gpt import gpt_layers
from pipeckpt.planning import plan


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
    sync_mark = report._mark

    def step(probe: bool, sync: bool = False) -> float:
        report._mark = (lambda d: report._now(d)) if sync else sync_mark  # type: ignore[assignment]
        p = (
            report._Probe(seq, list(stage_plan.ranges), list(stage_plan.devices), memory=False)
            if probe
            else None
        )
        seq.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        out = engine.forward(x)
        F.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
        if p is not None:
            p.remove()
            p.resolve()
        _sync(device)
        seconds = time.perf_counter() - start
        report._mark = sync_mark  # type: ignore[assignment]
        return seconds

    variants: Dict[str, Callable[[], float]] = {
        "probe": lambda: step(True),
        "probe+sync": lambda: step(True, sync=True),
    }
    for _ in range(2):  # warm-up
        step(False)
        for run in variants.values():
            run()
    ratios: Dict[str, List[float]] = {name: [] for name in variants}
    plains: List[float] = []
    for _ in range(args.rounds):
        for name, run in variants.items():
            before = step(False)
            measured = run()
            after = step(False)
            plains += [before, after]
            ratios[name].append(measured / ((before + after) / 2))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# report cost, {device_name}; {machine()}")
    print(
        f"GPT d {args.d_model} x {args.layers} layers, vocab {args.vocab}, seq {args.seq}, "
        f"batch {args.batch}, "
        f"{args.stages} stages x {args.chunks} chunks, {args.mode}; plain step median "
        f"{statistics.median(plains) * 1e3:.1f} ms; {args.rounds} interleaved rounds"
    )
    print("| variant | step time vs plain (median) | min | max |")
    print("|---|---|---|---|")
    for name, values in ratios.items():
        print(f"| {name} | {statistics.median(values):.4f} | {min(values):.4f} | {max(values):.4f} |")


if __name__ == "__main__":
    main()
