"""The distributed-engine benchmark's Markdown section (``benchmarks/bench_distributed.py``): speed-up
against the ideal and the machine's bound per schedule and micro-batch count, and each rank's peak
activation memory under GPipe and 1F1B, from the rounds ``main`` collected.

Apart from the script because it only reads figures and writes text: nothing here runs a step.
"""

import argparse
import statistics
from typing import Any, Dict, List

from distributed_measure import MICROBATCHES, SCHEDULES
from harness.machine import machine

from pipeckpt.app.models import MLP
from pipeckpt.sizes import MiB


def report(
    args: argparse.Namespace, model: Dict[str, int], rounds: List[Dict[str, Any]], elapsed: float
) -> str:
    params = sum(p.numel() for p in MLP(**model).parameters())
    median = statistics.median
    lines = [
        "## Distributed engine: two processes against one",
        "",
        f"Machine: {machine()}. One torch thread per process; gloo on localhost.",
        f"Model: `pipeckpt.app.models.MLP({', '.join(f'{k}={v}' for k, v in model.items())})` "
        f"({params / 1e6:.1f}M parameters, fp32, AdamW), batch {args.batch}, 2 stages balanced by "
        "parameters, no activation checkpointing. Each figure: the mean step time over "
        f"{args.timed} steps after {args.warmup} warm-up steps, through a `Trainer`; "
        f"{len(rounds)} round(s), medians. Wall time of the run: {elapsed / 60:.1f} min. "
        f"Command: `python benchmarks/bench_distributed.py{' --quick' if args.quick else ''} "
        f"--rounds {len(rounds)}`.",
        "",
        "Two processes cannot run twice as fast as one on every machine: the cores may share "
        "execution units, caches or a host's quota. The machine's capacity is measured in the same "
        "run: each process trains its half of the model alone on the whole batch (no pipeline, no "
        "messages) while the other does the same, against the whole model in one process, both "
        f"without Lightning: **{median([r['capacity'] for r in rounds]):.2f}x** (2.00 on two "
        "independent cores).",
        "",
        "Speed-up = one-process step time / pipeline step time, both through a `Trainer`. "
        "Ideal = 2M/(M+1), the bubble of a 2-stage pipeline on two independent cores. Machine "
        "bound = capacity x M/(M+1) x micro-batch efficiency, where micro-batch efficiency is the "
        "whole-batch step time over a one-process loop over the M micro-batches (smaller matrix "
        "products; no Lightning): what any 2-stage pipeline can reach on this machine. "
        "Raw schedule = torch's `ScheduleGPipe`/`Schedule1F1B` on the same halves without "
        "Lightning or pipeckpt, against the whole model without Lightning; pipeckpt / raw = the "
        "raw schedule's step time over the engine's.",
        "",
        "| M | schedule | speed-up | ideal | share of ideal | micro-batch efficiency | machine bound "
        "| share of machine bound | raw schedule speed-up | pipeckpt / raw |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in MICROBATCHES:
        efficiency = median([r["loop"][str(m)] for r in rounds])
        for schedule in SCHEDULES:
            speedups = [r["baseline"] / r["pipeline"][f"{schedule}/{m}"] for r in rounds]
            bounds = [r["capacity"] * m / (m + 1) * r["loop"][str(m)] for r in rounds]
            raws = [r["whole"] / r["pipeline"][f"raw {schedule}/{m}"] for r in rounds]
            own = [r["pipeline"][f"raw {schedule}/{m}"] / r["pipeline"][f"{schedule}/{m}"] for r in rounds]
            ideal = 2 * m / (m + 1)
            s = median(speedups)
            lines.append(
                f"| {m} | {schedule} | {s:.2f} | {ideal:.2f} | {s / ideal:.0%} | {efficiency:.2f} | "
                f"{median(bounds):.2f} | {median([a / b for a, b in zip(speedups, bounds)]):.0%} | "
                f"{median(raws):.2f} | {median(own):.2f} |"
            )
    last = rounds[-1]
    lines += [
        "",
        "Peak activation memory held for backward, per rank, GPipe against 1F1B (one step, no "
        "checkpointing; bytes of distinct saved storages, parameters excluded):",
        "",
        "| micro-batches M | rank (stage) | GPipe MiB | 1F1B MiB | 1F1B / GPipe |",
        "|---|---|---|---|---|",
    ]
    for m in MICROBATCHES:
        for rank in range(2):
            g, o = last["memory"][f"gpipe/{m}/{rank}"], last["memory"][f"1f1b/{m}/{rank}"]
            lines.append(f"| {m} | {rank} | {g / MiB:.1f} | {o / MiB:.1f} | {o / g:.2f} |")
    batch_bytes = args.batch * model["in_features"] * 4
    lines += [
        "",
        f"Rank 0's figures include the input batch ({batch_bytes / MiB:.1f} MiB), which the first "
        "layer keeps for its weight gradient under every schedule; the rest is "
        "`min(M, pp - rank)` micro-batches' activations under 1F1B against all M under GPipe. "
        f"One process, whole batch, for reference: {last['baseline_saved'] / MiB:.1f} MiB held "
        "for backward.",
        "",
    ]
    return "\n".join(lines)
