"""What pytree boundaries and side inputs cost the local engine, on two configs
(``--config``), one torch thread:

- ``proxy``: ``bench_dispatch``'s dispatch-bound CPU proxy (48 x Linear(64, 64) + GELU,
  batch 16, 4 stages, 4 micro-batches), where any per-stage, per-micro-batch Python work
  shows in full;
- ``gpt2``: the benchmark config, ``bench_checkpoint``'s FULL
  GPT-2-small-shaped decoder (12 blocks, d 768, vocab 8192, seq 128, batch 4, 4 stages x
  4 micro-batches, balance [4, 4, 4, 3]). Every layer is wrapped alike in all three
  variants (same module depth): ``tensor`` passes the hidden state, ``tree`` a dict
  ``{"h": hidden, "n": 3}`` (the tokens enter as ``{"h": tokens, "n": 3}``), ``side`` the
  hidden state plus a per-sample ``scale`` tensor every layer declares.

Compared, interleaved in one process (process CPU time; the ratio, and the difference in
ms per step, are taken within each round, the median over rounds reported):

- ``before`` / ``tree before`` / ``side before`` (proxy, ``--before``): the same three on an
  earlier engine (a ``git archive`` of that commit's ``pipeckpt/``, imports renamed, loaded
  as ``pipeckpt_before``);
- ``tensor``: this engine, the same tensor input (the fast path every tensor-only
  model keeps);
- ``tree``: this engine, every block taking and returning a dict ``{"h": tensor, "n": 3}``;
- ``side``: this engine with a keyword side input declared by every block (declared, not
  used, so that the layers' compute is the same);
- proxy only, ``tensor model`` / ``tree model`` / ``side model``: the same three models
  unpipelined, over the same 4 micro-batches one after the other: what the models' own
  Python costs (a dict built and read per block, a keyword per call), which the pipelined
  ratios include.

    python benchmarks/bench_pytree.py --config proxy --before DIR --out /tmp/proxy.md
    python benchmarks/bench_pytree.py --config gpt2 --rounds 5 --reps 2 --out /tmp/gpt2.md
"""

import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from harness.machine import machine
from torch import Tensor, nn

from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

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
        blocks = (TensorBlock, TreeBlock, SideBlock)
        old, old_tree, old_side = (pipe(before.LocalPipeline, model(block)) for block in blocks)
        out["before"] = lambda: old.forward(x).pow(2).mean().backward()
        out["tree before"] = lambda: old_tree.forward({"h": x, "n": 3})["h"].pow(2).mean().backward()
        out["side before"] = lambda: old_side.forward(x, scale=scale).pow(2).mean().backward()
    return out


def model_steps() -> Dict[str, Callable[[], None]]:
    """The proxy's three models unpipelined, micro-batch after micro-batch (no checkpointing)."""
    pieces = torch.randn(BATCH, WIDTH).chunk(CHUNKS)
    scales = torch.ones(BATCH, 1).chunk(CHUNKS)
    plain, tree, side = model(TensorBlock), model(TreeBlock), model(SideBlock)

    def run_side(x: Tensor, scale: Tensor) -> Tensor:
        for layer in side:
            x = layer(x, scale=scale)
        return x

    def step(outputs: List[Tensor]) -> None:
        torch.stack([o.pow(2).mean() for o in outputs]).sum().backward()

    return {
        "tensor model": lambda: step([plain(p) for p in pieces]),
        "tree model": lambda: step([tree({"h": p, "n": 3})["h"] for p in pieces]),
        "side model": lambda: step([run_side(p, s) for p, s in zip(pieces, scales)]),
    }


# -- the GPT-2-small-shaped config (bench_checkpoint.FULL) ---------------------------------

GPT = {"vocab_size": 8192, "d_model": 768, "n_heads": 12, "n_layers": 12, "seq_len": 128}
GPT_BATCH, GPT_BALANCE = 4, [4, 4, 4, 3]


class TensorWrap(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)


class TreeWrap(TensorWrap):
    def forward(self, tree: Dict[str, Any]) -> Dict[str, Any]:  # type: ignore[override]
        return {"h": self.layer(tree["h"]), "n": tree["n"]}


class SideWrap(TensorWrap):
    def forward(self, x: Tensor, scale: Optional[Tensor] = None) -> Tensor:  # type: ignore[override]
        return self.layer(x)


def gpt_model(wrap: type) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[wrap(layer) for layer in gpt_layers(**GPT, dropout=0.1)])


def gpt_steps(mode: str, before: Optional[Any]) -> Dict[str, Callable[[], None]]:
    tokens = torch.randint(0, GPT["vocab_size"], (GPT_BATCH, GPT["seq_len"]))
    scale = torch.ones(GPT_BATCH, 1, 1)

    def pipe(cls: Any, seq: nn.Sequential) -> Any:
        return cls(seq, plan(seq, devices=CPU, balance=GPT_BALANCE, checkpoint=mode), chunks=CHUNKS)

    tensor, tree, side = (pipe(LocalPipeline, gpt_model(w)) for w in (TensorWrap, TreeWrap, SideWrap))
    out: Dict[str, Callable[[], None]] = {
        "tensor": lambda: tensor.forward(tokens).float().pow(2).mean().backward(),
        "tree": lambda: tree.forward({"h": tokens, "n": 3})["h"].float().pow(2).mean().backward(),
        "side": lambda: side.forward(tokens, scale=scale).float().pow(2).mean().backward(),
    }
    if before is not None:
        old = pipe(before.LocalPipeline, gpt_model(TensorWrap))
        out["before"] = lambda: old.forward(tokens).float().pow(2).mean().backward()
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


def difference(times: Dict[str, List[float]], a: str, b: str) -> float:
    """The median over rounds of a's time minus b's: the added cost itself, in seconds per step."""
    return statistics.median(x - y for x, y in zip(times[a], times[b]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=("proxy", "gpt2"), default="proxy")
    parser.add_argument("--before", help="directory holding pipeckpt_before/ (an earlier engine, to compare)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    before = None
    if args.before:
        sys.path.insert(0, args.before)
        before = importlib.import_module("pipeckpt_before.engines.local_pipeline")
    title = "the CPU proxy" if args.config == "proxy" else "the GPT-2-small config (bench_checkpoint FULL)"
    lines = [
        f"# pytree boundaries: cost on {title}\n\n{machine()}\n",
        f"rounds {args.rounds} x {args.reps} steps, process CPU time; load average before: {load()}\n",
    ]
    lines += ["| mode | ratio | median |", "|---|---|---|"]
    for mode in ("never", "always"):
        methods = (steps if args.config == "proxy" else gpt_steps)(mode, before)
        if args.config == "proxy":
            methods.update(model_steps())
        times = measure(methods, args.rounds, args.reps)
        pairs = [("tree", "tensor"), ("side", "tensor")]
        if before:
            pairs += [("tensor", "before"), ("tree before", "before"), ("side before", "before")]
        if args.config == "proxy":
            pairs += [("tree model", "tensor model"), ("side model", "tensor model")]
        for a, b in pairs:
            lines.append(f"| {mode} | {a} / {b} | {ratio(times, a, b):.4f} |")
        for a, b in pairs[:2]:
            lines.append(f"| {mode} | {a} - {b} ms/step | {difference(times, a, b) * 1e3:+.3f} |")
        for name, values in times.items():
            lines.append(f"| {mode} | {name} ms/step | {statistics.median(values) * 1e3:.2f} |")
    lines.append(f"\nload average after: {load()}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def load() -> str:
    """The 1, 5 and 15 minute load averages (other jobs share the cores)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
