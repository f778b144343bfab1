"""Host-side cost of the local engine on a dispatch-bound CPU proxy.

The proxy: 48 x (``Linear(64, 64)`` + GELU), batch 16, one torch thread, 4 stages
of 12 blocks. Its kernels are so small that a step's time is mostly Python and
dispatch, as on a GPU whose kernels outrun the host: any per-stage, per-micro-batch
work of the engine shows up in full. Forward + mean-square loss + backward, no
optimizer.

Baselines, run in the same process on the same model and batch:

- ``plain``: one forward and backward of the whole batch (the 1-chunk target);
- ``loop``: a plain Python loop over the same 4 micro-batches, each with its own
  backward (gradient accumulation; the 4-chunk ``never`` target);
- ``forward``: the forward alone, under ``no_grad``, over the same 4 micro-batches
  (what recomputation adds: the ``always`` target is loop + forward);
  ``forward, whole batch`` is printed too.
- torchgpipe's own ``GPipe`` (never / always) for reference.

Measuring: process CPU time (with one torch thread it is the work done and far less
disturbed by other tenants of a shared machine than wall time; it also counts work in
any worker thread). Rounds are interleaved: every round runs each method for ``reps``
steps, in an order that rotates from round to round; a ratio is taken within each
round and the median over rounds is reported.

Commands::

    python benchmarks/bench_dispatch.py --out benchmarks/RESULTS_dispatch.md   # ~2 min
    python benchmarks/bench_dispatch.py --quick --out /tmp/dispatch.md          # seconds
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torchgpipe
from harness.machine import machine
from torch import Tensor, nn

from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

CPU = torch.device("cpu")
BLOCKS, WIDTH, BATCH, CHUNKS, STAGES = 48, 64, 16, 4, 4

Step = Callable[[], None]


def proxy(blocks: int = BLOCKS, width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)])


def loss(y: Tensor) -> Tensor:
    return y.pow(2).mean()


def methods(model: nn.Sequential, x: Tensor) -> Dict[str, Step]:
    parts = list(x.chunk(CHUNKS))
    balance = [len(model) // STAGES] * STAGES

    def plain() -> None:
        loss(model(x)).backward()

    def loop() -> None:
        for part in parts:
            (loss(model(part)) / len(parts)).backward()

    def forward() -> None:
        with torch.no_grad():
            for part in parts:
                model(part)

    def forward_whole() -> None:
        with torch.no_grad():
            model(x)

    def engine(mode: str, chunks: int) -> Step:
        pipe = LocalPipeline(
            model, plan(model, devices=[CPU], balance=balance, checkpoint=mode), chunks=chunks
        )
        return lambda: loss(pipe.forward(x)).backward()

    def gpipe(mode: str) -> Step:
        # torchgpipe's GPipe owns its layers: it gets a copy with the same weights.
        copy = proxy(len(model), model[0][0].in_features)
        copy.load_state_dict(model.state_dict())
        pipe = torchgpipe.GPipe(copy, balance=balance, devices=[CPU] * STAGES, chunks=CHUNKS, checkpoint=mode)
        return lambda: loss(pipe(x)).backward()

    return {
        "plain": plain,
        "loop": loop,
        "forward": forward,
        "forward, whole batch": forward_whole,
        "pipeckpt never, 1 chunk": engine("never", 1),
        "pipeckpt never": engine("never", CHUNKS),
        "pipeckpt except_last": engine("except_last", CHUNKS),
        "pipeckpt always": engine("always", CHUNKS),
        "torchgpipe never": gpipe("never"),
        "torchgpipe always": gpipe("always"),
    }


def cpu_time(step: Step, reps: int) -> float:
    start = time.process_time()
    for _ in range(reps):
        step()
    return (time.process_time() - start) / reps


def measure(steps: Dict[str, Step], *, rounds: int, reps: int) -> Dict[str, List[float]]:
    for step in steps.values():  # warm-up
        step()
        step()
    names = list(steps)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(cpu_time(steps[name], reps))
    return times


# (row, numerator, denominator methods (summed), target or None)
RATIOS: List[Tuple[str, str, Sequence[str], Optional[float]]] = [
    ("never, 1 chunk / plain", "pipeckpt never, 1 chunk", ["plain"], 1.05),
    ("never / loop", "pipeckpt never", ["loop"], 1.15),
    ("except_last / (loop + forward)", "pipeckpt except_last", ["loop", "forward"], None),
    ("always / (loop + forward)", "pipeckpt always", ["loop", "forward"], 1.15),
    ("always / (loop + whole-batch forward)", "pipeckpt always", ["loop", "forward, whole batch"], None),
    ("torchgpipe never / loop", "torchgpipe never", ["loop"], None),
    ("torchgpipe always / (loop + forward)", "torchgpipe always", ["loop", "forward"], None),
]


def ratio(times: Dict[str, List[float]], num: str, den: Sequence[str]) -> float:
    per_round = [times[num][r] / sum(times[d][r] for d in den) for r in range(len(times[num]))]
    return statistics.median(per_round)


def report(times: Dict[str, List[float]], *, rounds: int, reps: int) -> str:
    lines = [
        "# Dispatch-bound CPU proxy: host cost of the local engine",
        "",
        f"Machine: {machine()}.",
        f"Model: {BLOCKS} x (Linear({WIDTH}, {WIDTH}) + GELU), batch {BATCH}, {STAGES} stages, "
        f"{CHUNKS} chunks, 1 torch thread. Process CPU time, {rounds} interleaved rounds of {reps} steps.",
        "",
        "| ratio | median | target | verdict |",
        "|---|---|---|---|",
    ]
    for row, num, den, target in RATIOS:
        value = ratio(times, num, den)
        verdict = "" if target is None else ("met" if value <= target else "MISSED")
        lines.append(f"| {row} | {value:.2f} | {'' if target is None else f'<= {target:.2f}'} | {verdict} |")
    lines += ["", "| method | median CPU ms per step |", "|---|---|"]
    for name, values in times.items():
        lines.append(f"| {name} | {statistics.median(values) * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=10, help="steps per method per round")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 2 steps: checks the harness only")
    parser.add_argument("--out", type=Path, help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)
    rounds, reps = (3, 2) if args.quick else (args.rounds, args.reps)
    torch.set_num_threads(1)
    model = proxy()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    text = report(measure(methods(model, x), rounds=rounds, reps=reps), rounds=rounds, reps=reps)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
