"""What pytree boundaries and side inputs cost the local engine (issue 9), on
``bench_dispatch``'s dispatch-bound CPU proxy (48 x Linear(64, 64) + GELU, batch 16,
4 stages, 4 micro-batches, one torch thread), where any per-stage, per-micro-batch
Python work shows in full.

Compared, interleaved in one process (process CPU time; the ratio is taken within
each round, the median over rounds reported):

- ``before``: the tensor-only engine as it was before pytrees (``--before``: a
  ``git archive`` of that commit's ``pipeckpt/``, loaded as ``pipeckpt_before``);
- ``tensor``: this engine, the same tensor input (the fast path every tensor-only
  model keeps);
- ``tree``: this engine, every block taking and returning a dict ``{"h": tensor, "n": 3}``;
  ``tree, tensor blocks`` is its baseline with the same wrapper code around tensors;
- ``side``: this engine with a keyword side input declared by every block.

    python benchmarks/bench_pytree.py --before /tmp/pipeckpt_before --out benchmarks/RESULTS_pytree.md
"""

import argparse
import importlib
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from _machine import machine
from torch import Tensor, nn

from pipeckpt.engines.local_pipeline import LocalPipeline
from pipeckpt.planning import plan

BLOCKS, WIDTH, BATCH, CHUNKS, STAGES = 48, 64, 16, 4, 4
CPU = [torch.device("cpu")]


class TensorBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.gelu(self.lin(x))


class TreeBlock(TensorBlock):
    def forward(self, tree: Dict[str, Any]) -> Dict[str, Any]:  # type: ignore[override]
        return {"h": nn.functional.gelu(self.lin(tree["h"])), "n": tree["n"]}


class SideBlock(TensorBlock):
    def forward(self, x: Tensor, scale: Optional[Tensor] = None) -> Tensor:  # type: ignore[override]
        return nn.functional.gelu(self.lin(x))


def model(block: type) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[block(WIDTH) for _ in range(BLOCKS)])


def steps(mode: str, before: Optional[Any]) -> Dict[str, Callable[[], None]]:
    x = torch.randn(BATCH, WIDTH)
    scale = torch.ones(BATCH, 1)
    balance = [BLOCKS // STAGES] * STAGES

    def pipe(cls: Any, seq: nn.Sequential) -> Any:
        return cls(seq, plan(seq, devices=CPU, balance=balance, checkpoint=mode), chunks=CHUNKS)

    tensor, tree, side = pipe(LocalPipeline, model(TensorBlock)), pipe(LocalPipeline, model(TreeBlock)), None
    side = pipe(LocalPipeline, model(SideBlock))
    out: Dict[str, Callable[[], None]] = {
        "tensor": lambda: tensor.forward(x).pow(2).mean().backward(),
        "tree": lambda: tree.forward({"h": x, "n": 3})["h"].pow(2).mean().backward(),
        "side": lambda: side.forward(x, scale=scale).pow(2).mean().backward(),
    }
    if before is not None:
        old = pipe(before.LocalPipeline, model(TensorBlock))
        out["before"] = lambda: old.forward(x).pow(2).mean().backward()
    return out


def measure(methods: Dict[str, Callable[[], None]], rounds: int, reps: int) -> Dict[str, List[float]]:
    for step in methods.values():  # warm-up
        step()
    times: Dict[str, List[float]] = {k: [] for k in methods}
    names = list(methods)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.process_time()
            for _ in range(reps):
                methods[name]()
            times[name].append((time.process_time() - start) / reps)
    return times


def ratio(times: Dict[str, List[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", help="directory holding pipeckpt_before/ (the engine before pytrees)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    before = None
    if args.before:
        sys.path.insert(0, args.before)
        before = importlib.import_module("pipeckpt_before.engines.local_pipeline")
    lines = [
        f"# pytree boundaries: cost on the CPU proxy\n\n{machine()}\n",
        f"rounds {args.rounds} x {args.reps} steps\n",
    ]
    lines += ["| mode | ratio | median |", "|---|---|---|"]
    for mode in ("never", "always"):
        times = measure(steps(mode, before), args.rounds, args.reps)
        pairs = [("tree", "tensor"), ("side", "tensor")] + ([("tensor", "before")] if before else [])
        for a, b in pairs:
            lines.append(f"| {mode} | {a} / {b} | {ratio(times, a, b):.4f} |")
        for name, values in times.items():
            lines.append(f"| {mode} | {name} ms/step | {statistics.median(values) * 1e3:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
