"""Throughput and activation memory of the distributed engine on two processes.

A 2-stage pipeline of the project's MLP (``pipeckpt.app.models.MLP``) runs on two
processes of one torch thread each, against the same module trained in one
process with one thread. Both go through a real ``Trainer`` (the pipeline with
``PipelineStrategy(engine="distributed")``), so the figures include the engine's
whole cost: splitting the step, the schedule, gloo sends, the per-step
broadcast of the loss and logs, and Lightning's loop.

- Throughput: a pipeline of 2 equal stages and M micro-batches needs M + 1
  stage-slots per step where one process needs 2M, so its ideal speed-up is
  2M / (M + 1). Two more factors bound it on a real machine, and both are
  measured in the same run: the machine's capacity (two processes each training
  their half alone, against one process training the whole model; 2.0 on two
  independent cores) and the micro-batch efficiency (one process looping over
  the M micro-batches against the whole batch at once: smaller matrix products).
  torch's own schedules run on the same halves without Lightning or pipeckpt, so
  the engine's own cost shows as "pipeckpt / raw".
- Memory: per rank, the peak bytes of distinct storages autograd holds for
  backward (a ``saved_tensors_hooks`` counter; parameters excluded), during one
  step without checkpointing, under GPipe and 1F1B. GPipe keeps every
  micro-batch's activations until the backward phase; 1F1B keeps at most
  ``pp - rank`` micro-batches in flight on a rank.
- Time: all runs of one round happen back to back; the one-process baseline runs
  before and after the pipeline runs of the round and a ratio is against their
  mean. With more rounds the median ratio is reported.

Commands::

    python benchmarks/bench_distributed.py --rounds 3 --out benchmarks/RESULTS_distributed.md   # ~9 min
    python benchmarks/bench_distributed.py --quick --out /tmp/RESULTS_distributed.md

The section is written on its own; the distributed section of benchmarks/RESULTS.md is such a
run's output, pasted in beside the checkpointing benchmark.
"""

import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness.machine import machine
from harness.ranks import ranks_arguments, run_ranks
from harness.trainers import QUIET_CPU
from lightning.pytorch.callbacks import Callback
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy
from pipeckpt.app.models import MLP
from pipeckpt.sizes import MiB
from pipeckpt.stages.partition import plan, split

MICROBATCHES = (2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")


def model_settings(quick: bool) -> Dict[str, int]:
    if quick:
        return dict(in_features=64, hidden=64, depth=4, num_classes=10)
    return dict(in_features=1024, hidden=1024, depth=8, num_classes=10)


def loader(*, batch: int, steps: int, in_features: int, num_classes: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * steps, in_features, generator=g)
    y = torch.randint(0, num_classes, (batch * steps,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


class SavedBytes:
    """Distinct storages autograd holds for backward: live and peak bytes."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters() if not p.is_meta}
        self._refs: Dict[int, List[int]] = {}
        self.live = 0
        self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or key == 0:
            return t
        refs = self._refs.get(key)
        if refs is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            refs[0] += 1
        return _Held(self, key, t)

    def _unpack(self, held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        refs = self._refs[key]
        refs[0] -= 1
        if refs[0] == 0:
            self.live -= refs[1]
            del self._refs[key]


class _Held:
    def __init__(self, counter: SavedBytes, key: int, tensor: torch.Tensor) -> None:
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        self.counter.release(self.key)


class Measure(Callback):
    """Times the optimizer steps after `warmup`, then counts saved bytes in one more step."""

    def __init__(self, warmup: int, timed: int) -> None:
        self.warmup, self.timed = warmup, timed
        self.starts: List[float] = []
        self.batches = 0
        self._hooks: Any = None
        self.counter: Optional[SavedBytes] = None

    def on_train_batch_start(
        self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        if idx % trainer.accumulate_grad_batches == 0:
            self.starts.append(time.perf_counter())
        if len(self.starts) == self.warmup + self.timed + 1 and self._hooks is None:
            self.counter = SavedBytes(module)
            self._hooks = self.counter.hooks()
            self._hooks.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self._hooks is not None and (args[-1] + 1) % trainer.accumulate_grad_batches == 0:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def seconds_per_step(self) -> float:
        return (self.starts[self.warmup + self.timed] - self.starts[self.warmup]) / self.timed


def train(
    strategy: Any,
    *,
    devices: int,
    batch: int,
    accumulate: int,
    args: argparse.Namespace,
    model: Dict[str, int],
) -> Measure:
    steps = args.warmup + args.timed + 1
    measure = Measure(args.warmup, args.timed)
    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy=strategy,
        devices=devices,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[measure],
        **QUIET_CPU,
    )
    data = loader(
        batch=batch,
        steps=steps * accumulate,
        in_features=model["in_features"],
        num_classes=model["num_classes"],
    )
    trainer.fit(MLP(**model), data)
    return measure


# -- the two pipeline processes ---------------------------------------------------------


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
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    args = argparse.Namespace(**spec["args"])
    # Lightning finds this process group already up and keeps it.
    dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=2)
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


def pipeline_round(args: argparse.Namespace, model: Dict[str, int]) -> List[Dict[str, Any]]:
    """Both ranks started here, as torchrun would, so no launcher process competes for a core."""
    return run_ranks(__file__, 2, {"args": vars(args), "model": model}, timeout=args.timeout)


# -- the report ---------------------------------------------------------------------


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


def main() -> None:
    out = "benchmarks/RESULTS_distributed.md"
    parser = ranks_arguments(__doc__.splitlines()[0], out=out, rounds=1, batch=512)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.quick:
        args.batch, args.warmup, args.timed = 32, 1, 2
    torch.set_num_threads(1)
    model = model_settings(args.quick)
    began = time.time()
    rounds = []
    for _ in range(args.rounds):
        before = train("auto", devices=1, batch=args.batch, accumulate=1, args=args, model=model)
        whole = plain_whole(args, model)
        loop = {str(m): whole / plain_whole(args, model, m) for m in MICROBATCHES}
        pipeline = pipeline_round(args, model)
        after = train("auto", devices=1, batch=args.batch, accumulate=1, args=args, model=model)
        baseline = (before.seconds_per_step() + after.seconds_per_step()) / 2
        by_run: Dict[str, List[float]] = {}
        for r in pipeline:
            if "free" in r:
                by_run.setdefault("free", []).append(r["free"])
            else:
                by_run.setdefault(f"{r['schedule']}/{r['m']}", []).append(r["seconds"])
                by_run.setdefault(f"raw {r['schedule']}/{r['m']}", []).append(r["raw"])
        assert before.counter is not None
        rounds.append(
            {
                "baseline": baseline,
                "loop": loop,
                "capacity": whole / max(by_run.pop("free")),
                "whole": whole,
                "pipeline": {k: max(v) for k, v in by_run.items()},  # a step ends when both ranks are done
                "memory": {
                    f"{r['schedule']}/{r['m']}/{r['rank']}": r["saved_peak"]
                    for r in pipeline
                    if "free" not in r
                },
                "baseline_saved": before.counter.peak,
            }
        )
    text = report(args, model, rounds, time.time() - began)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
