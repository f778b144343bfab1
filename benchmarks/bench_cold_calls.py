"""What a small host call costs right after a stage's kernels, against the same call warm.

Why this exists: ``bench_host_cost.py --parts`` finds the distributed engine's host cost in about
ten pieces of 0.03-0.45 ms a step, each several times what the same Python costs in a warm loop.
A stage's kernels (here one micro-batch's forward and backward through the dispatch-bound proxy's
half: 16 x ``Linear(256, 256)``) evict the caches the interpreter and torch's dispatcher run from,
so the first call after them pays for its code and data again. This measures that price for
calls that follow a schedule's kernels, in one process of one torch thread:

- ``optimizer.zero_grad()`` with every gradient already ``None``: Lightning's zeroing after the
  engine's schedule, which has nothing left to zero;
- ``record_function`` entered and left: the profiler range torch's ``zero_grad`` and ``step`` open;
- a Python loop that sets the 32 parameters' ``.grad`` to ``None``: what that zeroing does, alone;
- ``torch.tensor`` of 3 floats and ``.tolist()``: the outcome message a step sends and reads.

Each round runs the kernels, times one call (cold), then times it again at once (warm), by the
thread's CPU clock; the timer's own cost (an empty call, timed the same way) is subtracted. Rounds
interleave the calls; medians are reported. ::

    python benchmarks/bench_cold_calls.py --out /tmp/cold_calls.md   # ~10 s
"""

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
from harness.machine import machine
from torch import nn


def _kernels(layers: nn.Sequential, x: torch.Tensor, params: List[nn.Parameter]) -> None:
    """One micro-batch's forward and backward through ``layers``; the gradients dropped after."""
    layers(x).sum().backward()
    for p in params:
        p.grad = None


EMPTY = "an empty call (the timer's own cost, subtracted from the rows above)"


def _calls(optimizer: torch.optim.Optimizer, params: List[nn.Parameter]) -> Dict[str, Callable[[], object]]:
    def record() -> None:
        with torch.autograd.profiler.record_function("probe"):
            pass

    def plain_zeroing() -> None:
        for p in params:
            if p.grad is not None:
                p.grad = None

    return {
        "`optimizer.zero_grad()`, every gradient already None": optimizer.zero_grad,
        "`record_function` entered and left": record,
        "a Python loop setting 32 `.grad` to None": plain_zeroing,
        "`torch.tensor` of 3 floats, then `.tolist()`": lambda: torch.tensor([1.0, 2.0, 3.0]).tolist(),
        EMPTY: lambda: None,
    }


def _timed(fn: Callable[[], object]) -> int:
    start = time.thread_time_ns()
    fn()
    return time.thread_time_ns() - start


def measure(rounds: int) -> Dict[str, Tuple[float, float]]:
    """Each call's median (cold, warm) CPU in microseconds, the timer's cost not subtracted."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])
    params = list(layers.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    x = torch.randn(16, 256)
    calls = _calls(optimizer, params)
    cold: Dict[str, List[int]] = {name: [] for name in calls}
    warm: Dict[str, List[int]] = {name: [] for name in calls}
    for r in range(rounds + 5):  # 5 rounds of warm-up
        for name, fn in calls.items():
            _kernels(layers, x, params)
            after, again = _timed(fn), _timed(fn)
            if r >= 5:
                cold[name].append(after)
                warm[name].append(again)
    med = statistics.median
    return {name: (med(cold[name]) / 1e3, med(warm[name]) / 1e3) for name in calls}


def report(results: Dict[str, Tuple[float, float]], rounds: int, elapsed: float) -> str:
    empty_cold, empty_warm = results[EMPTY]
    lines = [
        "## A small call right after a stage's kernels, against the same call warm "
        "(`benchmarks/bench_cold_calls.py`)",
        "",
        f"Machine: {machine()}. One process, one torch thread. Wall time of the run: {elapsed:.0f} s.",
        f"Kernels: one micro-batch (16 x 256) forward and backward through 16 x `Linear(256, 256)`. "
        f"Medians over {rounds} interleaved rounds of the thread's CPU time; the rows above the "
        "last have the empty call's time subtracted.",
        "",
        "| call | after the kernels, us | again at once, us | cold / warm |",
        "|---|---|---|---|",
    ]
    for name, (c, w) in results.items():
        if name == EMPTY:
            lines.append(f"| {name} | {c:.1f} | {w:.1f} | |")
            continue
        c, w = c - empty_cold, w - empty_warm
        ratio = f"{c / w:.1f}" if w > 0 else ""
        lines.append(f"| {name} | {c:.1f} | {w:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default="/tmp/cold_calls.md")
    args = parser.parse_args()
    start = time.perf_counter()
    results = measure(args.rounds)
    text = report(results, args.rounds, time.perf_counter() - start)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
