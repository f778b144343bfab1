"""Host cost of the distributed engine against a hand-written ``torch.distributed.pipelining`` script.

The dispatch-bound proxy: ``depth`` x ``Linear(width, width)``, 2 gloo processes of one torch
thread, 2 stages of equal halves, 1F1B over ``chunks`` micro-batches, AdamW, MSE loss. Its kernels
are so small that a step's time is mostly Python and dispatch, so any per-step or per-micro-batch
work of the engine shows in full (as on a GPU whose kernels outrun the host).

- ``raw``: what a user would write by hand: ``PipelineStage`` + ``Schedule1F1B`` on each rank's
  half, ``zero_grad``, ``schedule.step``, ``optimizer.step``, batches from the same ``DataLoader``.
- ``lightning``: the raw script's stage and schedule inside a Lightning ``Trainer`` (one device per
  process, automatic optimization, ``backward`` a no-op since the schedule runs it): what Lightning's
  loop costs any pipeline, the floor under which no strategy can go. ``pipeckpt / lightning`` is the
  engine's own host cost.
- ``pipeckpt``: the same module, data and optimizer through a Lightning ``Trainer`` with
  ``PipelineStrategy(engine="distributed")``. Its losses are asserted equal to the raw script's to
  the bit, every step, and so are both ranks' weights after the run.

Measuring: process CPU time (``time.process_time``: every thread of the process, gloo's included)
and wall time per optimizer step after warm-up, on each rank; a step's CPU is the *sum over both
ranks* (the host work one step costs), its wall time the slower rank's. Rounds are interleaved
(each method first in turn); a ratio is taken within each round, the median reported.
The schedule's own part is timed too: the engine's ``run`` + ``take_step_gradients`` against the raw
``schedule.step``; the rest of a pipeckpt step is Lightning's loop and the optimizer.

Commands::

    python benchmarks/bench_host_cost.py --rounds 9 --out /tmp/host_cost.md   # ~1.5 min, idle 2 cores
    python benchmarks/bench_host_cost.py --quick --out /tmp/host_cost.md      # seconds: checks the harness
    python benchmarks/bench_host_cost.py --calls --out /tmp/host_calls.md     # ~1 min: Python calls per step

``--parts`` splits a step of Lightning + raw and of pipeckpt into its parts, by the main thread's
CPU time (``time.thread_time``) spent in each of a few methods that both runs call: the schedule's
``step``, the stage's ``forward_one_chunk`` and ``backward_one_chunk``, and the strategy's
``training_step``, ``backward`` and ``optimizer_step`` (which runs the closure: training_step,
zeroing, backward, then the optimizer; Lightning + raw zeroes inside its ``training_step``, as the
raw script does, pipeckpt in Lightning's own zeroing). Rounds alternate which runs first; each
part's difference is the median of the per-round differences, per rank: where the engine's own
cost sits.

    python benchmarks/bench_host_cost.py --parts --rounds 14 --out /tmp/host_parts.md  # ~1 min

``--calls`` counts instead of timing: the Python and builtin function calls (cProfile's count) each
rank makes per step, the same on every run and under any load, where the CPU ratios of this 2-core
machine resolve about +-0.03. A count weighs every call alike, a tensor operation made by an operator
not at all: it tells where the engine's own Python went, the CPU ratio what it costs.
"""

import cProfile
import json
import math
import os
import pstats
import resource
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness.machine import machine
from harness.ranks import ranks_arguments, run_ranks
from harness.trainers import QUIET_CPU
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy

METHODS = ("raw", "lightning", "pipeckpt")


class Proxy(L.LightningModule):
    """``depth`` x ``Linear(width, width)``, MSE against a target, AdamW."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(spec: Dict[str, Any], steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    batch, width = spec["batch"], spec["width"]
    x = torch.randn(batch * steps, width, generator=g)
    y = torch.randn(batch * steps, width, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


class Clock:
    """CPU and wall time at the start of every step, and the CPU spent inside the schedule's part."""

    parts: Optional["Parts"] = None  # ``--parts``: times its methods in every clock's timed steps
    last: Optional["Clock"] = None  # the clock made last

    def __init__(self, spec: Dict[str, Any]) -> None:
        Clock.last = self
        self.warmup, self.steps = spec["warmup"], spec["timed"]  # the window of timed steps
        self.profiler = cProfile.Profile() if spec.get("calls") else None
        self.calls = 0  # function calls made in the timed steps (``--calls``)
        self.cpu: List[float] = []
        self.main: List[float] = []  # the main thread's CPU (the process's less gloo's threads)
        self.sys: List[float] = []  # the process's CPU in the kernel
        self.wall: List[float] = []
        self.inner = 0.0

    def tick(self) -> None:
        if Clock.parts is not None:
            Clock.parts.turn(self)
        self.cpu.append(time.process_time())
        self.main.append(time.thread_time())
        self.sys.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime)
        self.wall.append(time.perf_counter())
        if self.profiler is not None:  # count the calls of the timed steps (the main thread's)
            if len(self.cpu) == self.warmup + 1:
                self.profiler.enable()
            elif len(self.cpu) == self.warmup + self.steps + 1:
                self.profiler.disable()
                self.calls = sum(row[1] for row in pstats.Stats(self.profiler).stats.values())  # type: ignore[attr-defined]

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, its CPU time added to ``inner`` during the timed steps."""

        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.warmup < len(self.cpu) <= self.warmup + self.steps:
                return fn(*args, **kwargs)
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inner += time.process_time() - start

        return run

    def per_step(self) -> Dict[str, float]:
        warmup, timed = self.warmup, self.steps
        return {
            "cpu": (self.cpu[warmup + timed] - self.cpu[warmup]) / timed,
            "main": (self.main[warmup + timed] - self.main[warmup]) / timed,
            "sys": (self.sys[warmup + timed] - self.sys[warmup]) / timed,
            "wall": (self.wall[warmup + timed] - self.wall[warmup]) / timed,
            "inner": self.inner / timed,
            "calls": self.calls / timed,
        }


def half_schedule(layers: nn.Sequential, m: int) -> Tuple[nn.Sequential, Schedule1F1B]:
    """This rank's half of ``layers`` and the hand-written 1F1B schedule over it (``m`` micro-batches,
    each micro-batch's loss divided by ``m``), as the raw script and Lightning + raw both run it."""
    rank = dist.get_rank()
    half = len(layers) // 2
    part = layers[:half] if rank == 0 else layers[half:]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    return part, Schedule1F1B(stage, m, loss_fn=lambda out, y: F.mse_loss(out, y) / m, scale_grads=False)


def step_loss(losses: List[Tensor], m: int) -> Tensor:
    """The step's mean loss from the schedule's per-micro-batch losses (each divided by ``m``)."""
    return torch.stack([loss.detach() * m for loss in losses]).mean()


def raw(spec: Dict[str, Any]) -> Tuple[Dict[str, float], List[float], List[Tensor]]:
    """The hand-written script: per-step times, the mean loss of each step (last rank) and the weights."""
    warmup, timed, m = spec["warmup"], spec["timed"], spec["chunks"]
    rank = dist.get_rank()
    torch.manual_seed(0)
    part, schedule = half_schedule(Proxy(spec["depth"], spec["width"]).layers, m)
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-3)
    clock, losses = Clock(spec), []
    step = clock.timed(schedule.step)
    for x, y in loader(spec, warmup + timed + 1):
        clock.tick()
        optimizer.zero_grad()
        if rank == 0:
            step(x)
        else:
            out: List[Tensor] = []
            step(target=y, losses=out)
            losses.append(step_loss(out, m).item())
        optimizer.step()
    clock.tick()
    return clock.per_step(), losses, [p.detach().clone() for p in part.parameters()]


class _HandWritten(Proxy):
    """The raw script's stage and schedule, run in ``training_step``, which zeroes the gradients
    first as the script does: Lightning's own zeroing (between ``training_step`` and ``backward``)
    and its ``backward`` do nothing, as the schedule ran the backward. Each process is a one-device
    Trainer of its own half."""

    def __init__(self, spec: Dict[str, Any], clock: Clock) -> None:
        super().__init__(spec["depth"], spec["width"])
        m = spec["chunks"]
        part, schedule = half_schedule(self.layers, m)
        self.rank, self.chunks, self.part = dist.get_rank(), m, [part]
        self.step = clock.timed(schedule.step)

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.optimizer.zero_grad()
        if self.rank == 0:
            self.step(x)
            return torch.zeros(())
        out: List[Tensor] = []
        self.step(target=y, losses=out)
        return step_loss(out, self.chunks)

    def optimizer_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        pass

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.optimizer = torch.optim.AdamW(self.part[0].parameters(), lr=1e-3)
        return self.optimizer


def lightning(spec: Dict[str, Any]) -> Tuple[Dict[str, float], List[float], List[Tensor]]:
    """The raw script's schedule inside Lightning's loop."""
    warmup, timed = spec["warmup"], spec["timed"]
    clock = Clock(spec)
    measure = _Measure(clock, engine=False)
    torch.manual_seed(0)
    module = _HandWritten(spec, clock)
    trainer = L.Trainer(devices=1, max_steps=warmup + timed + 1, callbacks=[measure], **QUIET_CPU)
    trainer.fit(module, loader(spec, warmup + timed + 1))
    weights = [p.detach().clone() for p in module.part[0].parameters()]
    return clock.per_step(), measure.losses, weights


class _Measure(Callback):
    def __init__(self, clock: Clock, engine: bool = True) -> None:
        self.clock, self.engine = clock, engine
        self.losses: List[float] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not self.engine:
            return
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        engine.run = self.clock.timed(engine.run)
        engine.take_step_gradients = self.clock.timed(engine.take_step_gradients)

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.tick()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, *args: Any) -> None:
        self.clock.tick()


def pipeckpt(spec: Dict[str, Any]) -> Tuple[Dict[str, float], List[float], List[Tensor]]:
    """The same work through a Trainer and the distributed engine."""
    warmup, timed = spec["warmup"], spec["timed"]
    clock = Clock(spec)
    measure = _Measure(clock)
    torch.manual_seed(0)
    module = Proxy(spec["depth"], spec["width"])
    half = spec["depth"] // 2
    strategy = PipelineStrategy(
        engine="distributed", balance=[half, half], chunks=spec["chunks"], schedule="1f1b", checkpoint="never"
    )
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        max_steps=warmup + timed + 1,
        callbacks=[measure],
        **QUIET_CPU,
    )
    trainer.fit(module, loader(spec, warmup + timed + 1))
    layers = module.layers
    part = layers[:half] if dist.get_rank() == 0 else layers[half:]
    return clock.per_step(), measure.losses, [p.detach().clone() for p in part.parameters()]


class Parts:
    """Main-thread CPU per step in each of the methods named in the module's docstring (``--parts``),
    over the timed steps of the run whose ``Clock`` it watches; a method re-entered from within
    itself (an override calling its parent) counts once."""

    METHODS = (
        ("schedule", Schedule1F1B, "step"),
        ("forward chunks", PipelineStage, "forward_one_chunk"),
        ("backward chunks", PipelineStage, "backward_one_chunk"),
        ("training_step", Strategy, "training_step"),
        ("training_step", PipelineStrategy, "training_step"),
        ("backward", Strategy, "backward"),
        ("backward", PipelineStrategy, "backward"),
        ("optimizer_step", Strategy, "optimizer_step"),
    )

    def __init__(self) -> None:
        self.on = False
        self.cpu: Dict[str, float] = {}
        self._inside: Dict[str, int] = {}
        for key, owner, name in self.METHODS:
            setattr(owner, name, self._timed(key, getattr(owner, name)))

    def _timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.on or self._inside.get(key):
                return fn(*args, **kwargs)
            self._inside[key] = 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[key] = self.cpu.get(key, 0.0) + time.thread_time() - start
                self._inside[key] = 0

        return run

    def turn(self, clock: Clock) -> None:
        """At a tick of ``clock`` (before it is counted): on at its first timed step, off after its last."""
        ticks = len(clock.cpu) + 1
        if ticks == clock.warmup + 1:
            self.cpu, self.on = {}, True
        elif ticks == clock.warmup + clock.steps + 1:
            self.on = False

    def per_step(self, clock: Clock) -> Dict[str, float]:
        c = {key: self.cpu.get(key, 0.0) / clock.steps for key, _, _ in self.METHODS}
        step = clock.per_step()["main"]
        return {
            "the schedule: forward chunks": c["forward chunks"],
            "the schedule: backward chunks": c["backward chunks"],
            "the schedule: the rest (losses, messages, its own logic)": c["schedule"]
            - c["forward chunks"]
            - c["backward chunks"],
            "training_step outside the schedule": c["training_step"] - c["schedule"],
            "the backward hook": c["backward"],
            "the optimizer and zeroing": c["optimizer_step"] - c["training_step"] - c["backward"],
            "the loop outside optimizer_step": step - c["optimizer_step"],
            "whole step (main thread)": step,
        }


def worker(spec_path: str) -> None:
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("pin") and len(os.sched_getaffinity(0)) >= 2:  # each rank and its gloo threads on a core
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})
    dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=2)
    if spec.get("parts"):
        rows = parts_rows(spec)
    else:
        rows = timed_rows(spec)
    with open(os.path.join(spec["out"], f"rank{os.environ['LOCAL_RANK']}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def parts_rows(spec: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``--parts``: each round's parts of a step, Lightning + raw and pipeckpt, first in turn."""
    parts, rows = Parts(), []
    Clock.parts = parts
    for r in range(spec["rounds"]):
        for method in ("lightning", "pipeckpt") if r % 2 == 0 else ("pipeckpt", "lightning"):
            dist.barrier()
            {"lightning": lightning, "pipeckpt": pipeckpt}[method](spec)
            assert Clock.last is not None
            rows.append({"round": r, "method": method, "rank": dist.get_rank(), **parts.per_step(Clock.last)})
    return rows


def timed_rows(spec: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each round's per-step times of every method (each first in turn), checked equal in losses
    and weights to the raw script's."""
    rows = []
    for r in range(spec["rounds"]):
        order = METHODS[r % 3 :] + METHODS[: r % 3]  # each method first in turn
        ran: Dict[str, Tuple[Dict[str, float], List[float], List[Tensor]]] = {}
        for method in order:
            dist.barrier()
            ran[method] = {"raw": raw, "lightning": lightning, "pipeckpt": pipeckpt}[method](spec)
        for method in METHODS[1:]:
            if dist.get_rank() == 1:  # the last stage holds the raw script's losses
                assert ran["raw"][1] == ran[method][1], (method, ran["raw"][1], ran[method][1])
            for a, b in zip(ran["raw"][2], ran[method][2], strict=True):
                assert torch.equal(a, b), f"{method}'s weights differ from the raw script's"
        for method in METHODS:
            rows.append({"round": r, "method": method, "rank": dist.get_rank(), **ran[method][0]})
    return rows


def per_round(rows: List[Dict[str, Any]], rounds: int) -> List[Dict[str, Dict[str, float]]]:
    """Each round's step of each method: CPU and inner CPU summed over ranks, wall time the slower rank's."""
    out = []
    for r in range(rounds):
        by_method = {}
        for method in METHODS:
            mine = [row for row in rows if row["round"] == r and row["method"] == method]
            by_method[method] = {
                "cpu": sum(row["cpu"] for row in mine),
                "main": sum(row["main"] for row in mine),
                "sys": sum(row["sys"] for row in mine),
                "inner": sum(row["inner"] for row in mine),
                "wall": max(row["wall"] for row in mine),
                **{f"cpu{row['rank']}": row["cpu"] for row in mine},
            }
        out.append(by_method)
    return out


def load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def report(
    spec: Dict[str, Any], rounds: List[Dict[str, Dict[str, float]]], loads: List[str], elapsed: float
) -> str:
    med = statistics.median

    def value(r: Dict[str, Dict[str, float]], method: str, key: str) -> float:
        if key == "rest":  # everything outside the schedule's part: loop, data, optimizer
            return r[method]["cpu"] - r[method]["inner"]
        return r[method][key]

    def ratio(key: str, num: str, den: str) -> float:
        pairs = [(value(r, num, key), value(r, den, key)) for r in rounds]
        # nan where a round measured nothing (a --quick run's kernel time can be 0)
        return med([a / b if b else math.nan for a, b in pairs])

    def row(name: str, key: str) -> str:
        ms = [f"{med([value(r, m, key) for r in rounds]) * 1e3:.2f}" for m in METHODS]
        ratios = [
            f"{ratio(key, 'pipeckpt', 'lightning'):.3f}",
            f"{ratio(key, 'pipeckpt', 'raw'):.3f}",
            f"{ratio(key, 'lightning', 'raw'):.3f}",
        ]
        return f"| {name} | {' | '.join(ms)} | {' | '.join(ratios)} |"

    def per_round_list(num: str, den: str) -> str:
        return " ".join(f"{r[num]['cpu'] / r[den]['cpu']:.3f}" for r in rounds)

    lines = [
        "## Host cost: the distributed engine against a hand-written pipelining script "
        "(`benchmarks/bench_host_cost.py`)",
        "",
        f"Machine: {machine()}. Load average (1/5/15 min) before and after the run: {loads[0]}; "
        f"{loads[1]}. Wall time of the run: {elapsed / 60:.1f} min.",
        f"Model: {spec['depth']} x `Linear({spec['width']}, {spec['width']})`, batch {spec['batch']}, "
        f"2 gloo processes of one torch thread, 2 stages of {spec['depth'] // 2}, 1F1B over "
        f"{spec['chunks']} micro-batches, AdamW, no activation checkpointing. Losses of every step "
        "and both ranks' final weights asserted equal to the raw script's to the bit, for every "
        f"method. Per step after {spec['warmup']} warm-up steps, mean of {spec['timed']} steps; "
        f"{len(rounds)} rounds, each method first in turn; medians of per-round ratios. CPU: "
        "process CPU time summed over both ranks; wall: the slower rank's. Methods: raw = the "
        "hand-written script; Lightning + raw = the same stage and schedule inside a Lightning "
        "`Trainer` (Lightning's loop around it, nothing else); pipeckpt = "
        '`PipelineStrategy(engine="distributed")`. Command: `python benchmarks/bench_host_cost.py'
        f"{' --quick' if spec['quick'] else ''}{' --pin' if spec.get('pin') else ''} --rounds {len(rounds)}`"
        f"{' (each rank pinned to a core of its own)' if spec.get('pin') else ''}.",
        "",
        "| part of a step | raw CPU ms | Lightning + raw CPU ms | pipeckpt CPU ms | "
        "**pipeckpt / (Lightning + raw)**: the engine's own cost | pipeckpt / raw | "
        "(Lightning + raw) / raw: Lightning's loop |",
        "|---|---|---|---|---|---|---|",
        row("whole step", "cpu"),
        row("schedule: `schedule.step` / the engine's `run` + `take_step_gradients`", "inner"),
        row("the rest: loop, data, optimizer", "rest"),
        row("main threads only (the rest is gloo's threads)", "main"),
        row("in the kernel (system CPU time)", "sys"),
        row("rank 0 (first stage), whole step", "cpu0"),
        row("rank 1 (last stage), whole step", "cpu1"),
        row("wall time per step", "wall"),
        "",
        "Whole-step CPU ratios of each round, in order (the spread is the machine's noise):",
        f"pipeckpt / (Lightning + raw): {per_round_list('pipeckpt', 'lightning')};",
        f"pipeckpt / raw: {per_round_list('pipeckpt', 'raw')};",
        f"(Lightning + raw) / raw: {per_round_list('lightning', 'raw')}.",
        "",
    ]
    return "\n".join(lines)


def report_calls(spec: Dict[str, Any], rows: List[Dict[str, Any]], elapsed: float) -> str:
    """``--calls``: each method's function calls per step on each rank, and their ratios."""
    calls = {(row["method"], row["rank"]): row["calls"] for row in rows}
    total = {m: calls[m, 0] + calls[m, 1] for m in METHODS}
    lines = [
        "## Host cost as a count: Python calls per step (`benchmarks/bench_host_cost.py --calls`)",
        "",
        f"Machine: {machine()}. Wall time of the run: {elapsed / 60:.1f} min. Same model, data and "
        f"methods as the timed run ({spec['depth']} x `Linear({spec['width']}, {spec['width']})`, batch "
        f"{spec['batch']}, 2 processes, 1F1B over {spec['chunks']} micro-batches); per step, the mean "
        f"over {spec['timed']} steps after {spec['warmup']} warm-up steps, of the Python and builtin "
        "function calls cProfile counts in each rank's main thread (a count, the same on every run; "
        "its timings are not used).",
        "",
        "| method | rank 0 (first stage) | rank 1 (last stage) | both | / raw | / (Lightning + raw) |",
        "|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        lines.append(
            f"| {m} | {calls[m, 0]:.0f} | {calls[m, 1]:.0f} | {total[m]:.0f} | "
            f"{total[m] / total['raw']:.3f} | {total[m] / total['lightning']:.3f} |"
        )
    return "\n".join([*lines, ""])


def report_parts(spec: Dict[str, Any], rows: List[Dict[str, Any]], elapsed: float) -> str:
    """``--parts``: per rank, each part's CPU ms per step under both runs and the median difference."""
    med = statistics.median
    names = [k for k in rows[0] if k not in ("round", "method", "rank")]
    lines = [
        "## Where a step's host time goes: Lightning + raw against pipeckpt, part by part "
        "(`benchmarks/bench_host_cost.py --parts`)",
        "",
        f"Machine: {machine()}. Wall time of the run: {elapsed / 60:.1f} min. Same model, data and "
        f"methods as the timed run ({spec['depth']} x `Linear({spec['width']}, {spec['width']})`, "
        f"batch {spec['batch']}, 2 processes, 1F1B over {spec['chunks']} micro-batches); the main "
        f"thread's CPU ms per step, mean of {spec['timed']} steps after {spec['warmup']} warm-up steps; "
        f"{spec['rounds']} rounds, which run goes first alternating; median over rounds, and the "
        "median of the per-round differences (pipeckpt - Lightning + raw), which is steadier.",
        "",
        "| part of a step | rank | Lightning + raw ms | pipeckpt ms | difference ms (median) | "
        "difference / Lightning + raw's step |",
        "|---|---|---|---|---|---|",
    ]
    rounds = range(spec["rounds"])
    # each rank's whole step under Lightning + raw, the denominator of every part's share
    light_rows = [x for x in rows if x["method"] == "lightning"]
    step = "whole step (main thread)"
    steps = {rank: med(x[step] for x in light_rows if x["rank"] == rank) for rank in (0, 1)}
    for name in names:
        for rank in (0, 1):
            mine = {(x["round"], x["method"]): x[name] for x in rows if x["rank"] == rank}
            light = med(mine[r, "lightning"] for r in rounds)
            piped = med(mine[r, "pipeckpt"] for r in rounds)
            diff = med(mine[r, "pipeckpt"] - mine[r, "lightning"] for r in rounds)
            share = diff / steps[rank]
            lines.append(
                f"| {name} | {rank} | {light * 1e3:.3f} | {piped * 1e3:.3f} "
                f"| {diff * 1e3:+.3f} | {share * 100:+.1f}% |"
            )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = ranks_arguments(__doc__.splitlines()[0], out="/tmp/host_cost.md", rounds=9, batch=64)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--pin", action="store_true", help="each rank on a core of its own")
    parser.add_argument("--calls", action="store_true", help="count Python calls per step instead of timing")
    parser.add_argument(
        "--parts", action="store_true", help="split a step into parts by the main thread's CPU"
    )
    parser.set_defaults(warmup=5, timed=30)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        # Its rows are written and its group destroyed: leave without the interpreter's teardown, where
        # a C++ thread of the finished run was now and then destroyed still joinable ("terminate called
        # without an active exception", an abort after the work was done, seen under a loaded CI run).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.quick:
        args.depth, args.width, args.batch, args.warmup, args.timed, args.rounds = 4, 16, 8, 1, 2, 1
    if args.calls:  # a count: one round gives it
        args.rounds = 1
    spec = {
        k: getattr(args, k)
        for k in (
            "depth",
            "width",
            "batch",
            "chunks",
            "warmup",
            "timed",
            "rounds",
            "quick",
            "pin",
            "calls",
            "parts",
        )
    }
    began, loads = time.time(), [load_average()]
    rows = run_ranks(__file__, 2, spec, timeout=args.timeout)
    loads.append(load_average())
    if args.calls:
        text = report_calls(spec, rows, time.time() - began)
    elif args.parts:
        text = report_parts(spec, rows, time.time() - began)
    else:
        text = report(spec, per_round(rows, args.rounds), loads, time.time() - began)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
