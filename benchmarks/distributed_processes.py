"""The distributed-engine benchmark's runs outside the one-process ``Trainer`` baseline
(``benchmarks/bench_distributed.py``): the yardsticks without Lightning or pipeckpt (the whole model
in one process, on the whole batch or looping over micro-batches; each rank's half trained alone;
torch's own schedules on the halves) and ``worker``, what each of the two pipeline processes runs.

Apart from the script because this is the work inside the ranks (and the one-process yardstick
measured beside them); the script starts the ranks, runs the rounds and writes the report.
"""

import argparse
import json
import os
import time
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_measure import MICROBATCHES, SCHEDULES, train
from harness.ranks import joined
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from pipeckpt import PipelineStrategy
from pipeckpt.app.models import MLP
from pipeckpt.stages.partition import plan, split


def _plain_steps(part: torch.nn.Module, x: torch.Tensor, loss_fn: Any, args: argparse.Namespace) -> float:
    optimizer = torch.optim.AdamW(part.parameters())
    starts = []
    for _ in range(args.warmup + args.timed + 1):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        loss_fn(part(x)).backward()
        optimizer.step()
    return (starts[-1] - starts[args.warmup]) / args.timed


def plain_whole(args: argparse.Namespace, model: Dict[str, int], m: int = 1) -> float:
    """Seconds per step of the whole model in this process, without Lightning, on the
    whole batch at once or as a loop over ``m`` micro-batches (gradient accumulation)."""
    torch.manual_seed(0)
    net = MLP(**model).layers
    x = torch.randn(args.batch, model["in_features"])
    y = torch.randint(0, model["num_classes"], (args.batch,))
    optimizer = torch.optim.AdamW(net.parameters())
    starts = []
    for _ in range(args.warmup + args.timed + 1):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
            (F.cross_entropy(net(xs), ys) / m).backward()
        optimizer.step()
    return (starts[-1] - starts[args.warmup]) / args.timed


def free_halves(args: argparse.Namespace, model: Dict[str, int]) -> float:
    """Seconds per step of this rank's half of the model trained alone on the whole batch, while
    the other rank does the same with its half: what two processes can do on this machine
    without waiting for each other."""
    torch.manual_seed(0)
    layers = MLP(**model).layers
    balance = plan(layers, devices=[torch.device("cpu")], stages=2).balance
    part = split(layers, balance)[dist.get_rank()]
    width = model["in_features"] if dist.get_rank() == 0 else model["hidden"]
    x = torch.randn(args.batch, width)
    y = torch.randint(0, model["num_classes"], (args.batch,))
    grad = torch.randn(args.batch, model["hidden"])
    dist.barrier()
    seconds = _plain_steps(
        part,
        x,
        (lambda out: F.cross_entropy(out, y)) if dist.get_rank() == 1 else (lambda out: (out * grad).sum()),
        args,
    )
    dist.barrier()
    return seconds


def raw_schedule(schedule: str, m: int, args: argparse.Namespace, model: Dict[str, int]) -> float:
    """Seconds per step of torch's own schedule on this rank's half, without Lightning or
    pipeckpt: the yardstick for the engine's own cost."""
    torch.manual_seed(0)
    layers = MLP(**model).layers
    balance = plan(layers, devices=[torch.device("cpu")], stages=2).balance
    rank = dist.get_rank()
    part = split(layers, balance)[rank]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = kind(stage, m, loss_fn=lambda out, y: F.cross_entropy(out, y) / m, scale_grads=False)
    optimizer = torch.optim.AdamW(part.parameters())
    x = torch.randn(args.batch, model["in_features"])
    y = torch.randint(0, model["num_classes"], (args.batch,))
    starts = []
    for _ in range(args.warmup + args.timed + 1):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        runner.step(x) if rank == 0 else runner.step(target=y)
        optimizer.step()
    return (starts[-1] - starts[args.warmup]) / args.timed


def worker(spec_path: str) -> None:
    spec, args = joined(spec_path)
    results = [{"free": free_halves(args, spec["model"]), "rank": dist.get_rank()}]
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            strategy = PipelineStrategy(
                engine="distributed", stages=2, chunks=m, schedule=schedule, checkpoint="never"
            )
            measure = train(
                strategy, devices=2, batch=args.batch, accumulate=1, args=args, model=spec["model"]
            )
            assert measure.counter is not None
            results.append(
                {
                    "schedule": schedule,
                    "m": m,
                    "seconds": measure.seconds_per_step(),
                    "raw": raw_schedule(schedule, m, args, spec["model"]),
                    "saved_peak": measure.counter.peak,
                    "rank": dist.get_rank(),
                }
            )
    with open(os.path.join(spec["out"], f"rank{os.environ['LOCAL_RANK']}.json"), "w") as f:
        json.dump(results, f)
