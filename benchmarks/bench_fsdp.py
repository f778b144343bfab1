"""Sharded against replicated stages: pp2 x fsdp2 against pp2 x ddp2 on four processes.

The same 2-stage pipeline of the project's MLP (``pipeckpt.app.models.MLP``) trains with AdamW
under ``data_parallel="ddp"`` and ``data_parallel="fsdp"`` (each replica reads its half of every
batch), through a real ``Trainer``, one torch thread per process.

- Bytes: per rank, after the last step, the bytes of the parameters, gradients and optimizer
  state that rank holds, counted from the tensors themselves (a DTensor's local shard; other
  ranks' layers on the meta device count nothing). Sharding should bring them to about half.
- Time: seconds per step after warm-up, the slowest rank's (a step ends when every rank is
  done); the two layouts run back to back in each round, and the ratio's median over rounds is
  reported.

Commands::

    python benchmarks/bench_fsdp.py --rounds 2 --timed 4 --out /tmp/RESULTS_fsdp.md   # about 3 min
    python benchmarks/bench_fsdp.py --quick --out /tmp/RESULTS_fsdp.md

The fsdp section of benchmarks/RESULTS.md is such a run's output, pasted in.
"""

import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness.machine import machine
from harness.ranks import ranks_arguments, run_ranks
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy
from pipeckpt.app.models import MLP
from pipeckpt.sizes import MiB

LAYOUTS = ("ddp", "fsdp")
WORLD, DP = 4, 2


def model_settings(quick: bool) -> Dict[str, int]:
    if quick:
        return dict(in_features=64, hidden=64, depth=4, num_classes=10)
    return dict(in_features=512, hidden=512, depth=8, num_classes=10)


class Module(L.LightningModule):
    def __init__(self, model: Dict[str, int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = MLP(**model).layers

    def configure_pipeline(self) -> torch.nn.Sequential:
        return self.net

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _bytes(t: Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return 0 if local.is_meta else local.numel() * local.element_size()


class Measure(Callback):
    """Step times after warm-up, and the bytes held after the last step."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.started = warmup, [], 0.0
        self.held: Dict[str, int] = {}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        dist.barrier()
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        dist.barrier()  # the slowest rank's step
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self.started)
        params = [p for p in module.parameters()]
        optimizer = trainer.optimizers[0]
        self.held = {
            "params": sum(_bytes(p) for p in params),
            "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
            "state": sum(_bytes(t) for s in optimizer.state.values() for t in s.values() if t.dim() > 0),
        }


def train(layout: str, args: argparse.Namespace, model: Dict[str, int], replica: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    steps = args.warmup + args.timed
    x = torch.randn(args.batch * steps, model["in_features"], generator=g)
    y = torch.randint(0, model["num_classes"], (args.batch * steps,), generator=g)
    share = args.batch // DP
    rows = torch.cat(
        [torch.arange(b + replica * share, b + (replica + 1) * share) for b in range(0, len(x), args.batch)]
    )
    loader = DataLoader(TensorDataset(x[rows], y[rows]), batch_size=share, shuffle=False)
    strategy = PipelineStrategy(
        engine="distributed",
        stages=2,
        dp=DP,
        chunks=4,
        schedule="1f1b",
        checkpoint="never",
        data_parallel=layout,
    )
    measure = Measure(args.warmup)
    trainer = L.Trainer(
        strategy=strategy,
        devices=WORLD,
        accelerator="cpu",
        max_steps=steps,
        callbacks=[measure],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Module(model), loader)
    return {
        "layout": layout,
        "seconds": statistics.median(measure.times),
        **measure.held,
        "rank": dist.get_rank(),
    }


def worker(spec_path: str) -> None:
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    args = argparse.Namespace(**spec["args"])
    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rows = [train(layout, args, spec["model"], replica=rank // (WORLD // DP)) for layout in LAYOUTS]
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def report(
    args: argparse.Namespace, model: Dict[str, int], rounds: List[List[Dict[str, Any]]], took: float
) -> str:
    last = rounds[-1]
    lines = [
        "## Sharded stages: pp2 x fsdp2 against pp2 x ddp2 (`benchmarks/bench_fsdp.py`)",
        "",
        f"Machine: {machine()}. MLP {model}, AdamW, batch {args.batch} ({args.batch // DP} per replica), "
        f"4 micro-batches, 1f1b, `never`; {len(rounds)} round(s) of {args.warmup} warm-up + {args.timed} "
        f"timed steps, {took / 60:.1f} min.",
        "",
        "| rank | ddp params + grads + state (MiB) | fsdp (MiB) | fsdp / ddp |",
        "|---|---|---|---|",
    ]
    worst = 0.0
    for rank in range(WORLD):
        held = {r["layout"]: r["params"] + r["grads"] + r["state"] for r in last if r["rank"] == rank}
        ratio = held["fsdp"] / held["ddp"]
        worst = max(worst, ratio)
        lines.append(f"| {rank} | {held['ddp'] / MiB:.2f} | {held['fsdp'] / MiB:.2f} | {ratio:.3f} |")
    ratios = []
    for rows in rounds:
        step = {layout: max(r["seconds"] for r in rows if r["layout"] == layout) for layout in LAYOUTS}
        ratios.append(step["fsdp"] / step["ddp"])
    lines += [
        "",
        f"Largest per-rank bytes ratio fsdp / ddp: {worst:.3f} (target <= 0.55). Step time fsdp / ddp: "
        f"median {statistics.median(ratios):.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)}).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = ranks_arguments(__doc__.splitlines()[0], out="/tmp/RESULTS_fsdp.md", rounds=1, batch=256)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.quick:
        args.batch, args.warmup, args.timed = 32, 1, 2
    model = model_settings(args.quick)
    began = time.time()
    spec = {"args": vars(args), "model": model}
    rounds = [run_ranks(__file__, WORLD, spec, timeout=args.timeout) for _ in range(args.rounds)]
    text = report(args, model, rounds, time.time() - began)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
