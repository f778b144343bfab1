"""Per-rank memory and recomputes of the distributed engine, for each schedule and checkpoint mode.

Why: the memory model (``pipeckpt.memory``) predicts per-stage peaks under torch's GPipe and 1F1B,
and the modes claim to trade memory for recomputation, but until this benchmark nothing measured
what a rank of ``engine="distributed"`` actually holds. Two gloo processes on CPU (one torch thread
each) train a GPT-like model (``pipeckpt.app.models.GPT``) and an MLP (``pipeckpt.app.models.MLP``)
through a real ``Trainer`` with ``PipelineStrategy(engine="distributed")``: one stage per rank for
GPipe and 1F1B, two virtual stages per rank for the looped schedules, and the zero-bubble schedules
with ``never`` only (the engine refuses recomputation under a split backward).

Measured, per rank, in the second training step (the first builds the schedule and infers shapes):

- peak MiB: the most bytes, at any operator, of the storages created since training began by
  operators that ran inside a training step's window (from ``on_train_batch_start`` to
  ``on_before_optimizer_step``), still alive: activations, the gradients the step computes, the
  recompute's working set, the schedule's receive buffers (made in the first step, reused) and
  the tensors its pending sends hold.
- previous .grad MiB: the first step's gradients still alive during the second step's schedule
  (seen at every forward of the rank's stages, by weak references): 0 since the engine drops
  them at the first batch of an accumulation window.
  Parameters, optimizer state and the data loader's batch are outside the windows, so they are
  not counted. Counted as ``benchmarks/harness/stage_memory.py`` counts the local engine (a dispatch mode, one
  "stage" here because a rank is one device).
- recomputes: runs of a stage's layers in the step beyond its one forward per micro-batch, summed
  over the rank's stages (``Stage.forward_calls``): what the code did, whatever the mode promises.
- predicted MiB, error %: ``pipeckpt.memory.predict.predict``'s per-stage peak (GPipe, 1F1B) or
  ``pipeckpt.memory.predict.predict_device``'s per-rank peak under the op order the rank ran (the looped
  schedules), less parameters and optimizer state (the same quantity), from a profile of one
  micro-batch in the launching process; error = (predicted - measured) / measured. The
  zero-bubble schedules split backward, which the model does not cover.

On CPU ``offload`` has no host to move to (the stage input already lives there), so it runs as
``always`` does.

Commands::

    python benchmarks/bench_distributed_memory.py --out /tmp/distmem.md            # ~1 min on 2 cores
    python benchmarks/bench_distributed_memory.py --models mlp --schedules gpipe --modes never,always
"""

import argparse
import json
import os
import sys
import time
import weakref
from typing import Any, Dict, List, Sequence, Tuple

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness.machine import machine
from harness.ranks import run_ranks
from harness.stage_memory import StageTracker
from harness.trainers import QUIET_CPU
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy
from pipeckpt.app.models import GPT, MLP
from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.memory.predict import predict, predict_device
from pipeckpt.memory.profile import profile
from pipeckpt.sizes import MiB
from pipeckpt.stages.partition import StagePlan

RANKS = 2
CHUNKS = 4
#: Schedule -> stages per rank. The zero-bubble ones are measured with "never" only (this table was
#: made when they refused recomputing modes; they run every mode now, docs/DISTRIBUTED.md).
SCHEDULES: Dict[str, int] = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "looped_bfs": 2,
    "interleaved_zero_bubble": 2,
    "zbv_zero_bubble": 2,
}
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble")
MODES = ("never", "except_last", "always", "offload")
PREDICTED = ("gpipe", "1f1b")  # pipeckpt.memory.predict.predict: one stage per device
LOOPED = ("interleaved_1f1b", "looped_bfs")  # pipeckpt.memory.predict.predict_device, the rank's own op order

MODELS: Dict[str, Dict[str, Any]] = {
    # GPT-2-shaped, small enough for two processes on two shared cores: 9 layers to balance.
    "gpt": {
        "kwargs": dict(size="tiny", n_layers=6, seq_len=64, vocab_size=256, dropout=0.1),
        "batch": 16,
    },
    "mlp": {"kwargs": dict(in_features=256, hidden=512, depth=4, num_classes=10), "batch": 256},
}


def build(name: str) -> L.LightningModule:
    torch.manual_seed(0)
    kwargs = MODELS[name]["kwargs"]
    return GPT(**kwargs) if name == "gpt" else MLP(**kwargs)


def data(name: str, batches: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n, kw = MODELS[name]["batch"] * batches, MODELS[name]["kwargs"]
    if name == "gpt":
        tokens = torch.randint(0, kw["vocab_size"], (n, kw["seq_len"] + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    x = torch.randn(n, kw["in_features"], generator=g)
    return x, torch.randint(0, kw["num_classes"], (n,), generator=g)


def loss_of(name: str) -> Any:
    if name == "gpt":
        return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy


def runs(models: Sequence[str], schedules: Sequence[str], modes: Sequence[str]) -> List[Tuple[str, str, str]]:
    return [
        (model, schedule, mode)
        for model in models
        for schedule in schedules
        for mode in modes
        if schedule not in SPLIT_BACKWARD or mode == "never"
    ]


# -- one rank ------------------------------------------------------------------------


class StepWindows(Callback):
    """Counts storages created inside each training step's window; keeps the peak and the
    recomputes of step ``measured`` (0-based)."""

    def __init__(self, measured: int) -> None:
        self.measured = measured
        self.tracker = StageTracker(1)
        self.peak = 0
        self.recomputes = 0
        self.previous_grads = 0
        self._calls = 0
        self._active = False
        self._previous: List[Tuple[Any, int]] = []
        self._hooked = False
        self.order: List[List[Any]] = []

    def _previous_alive(self, *_: Any) -> None:
        alive = sum(n for ref, n in self._previous if ref() is not None)
        self.previous_grads = max(self.previous_grads, alive)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # The op order each step hands the rank's stages (the schedule's own, for a looped one):
        # what the memory model walks for a device with several stages.
        schedules = trainer.strategy.engine.step.schedules
        orders = schedules.orders

        def recorded(schedule: Any, microbatches: int) -> Dict[int, List[Tuple[int, str, int]]]:
            out = orders(schedule, microbatches)
            self.order = [list(op) for op in next(iter(out.values()))]
            return out

        schedules.orders = recorded

    def on_train_batch_start(
        self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        # What exists before the step (parameters, buffers, the batch): views of it are not new memory.
        self.tracker.exclude([*module.parameters(), *module.buffers(), batch])
        if idx == self.measured:
            self.tracker.peak[0] = self.tracker.live[0]
            # The previous step's gradients: the engine drops them before the schedule at the first
            # batch of an accumulation window (every batch here); whatever of them stays alive
            # while the schedule runs is seen by the stages' forward hooks.
            self._previous = [
                (weakref.ref(p.grad), p.grad.untyped_storage().nbytes())
                for p in module.parameters()
                if p.grad is not None
            ]
            self._calls = sum(s.forward_calls for s in trainer.strategy.stages)
        if not self._hooked:
            self._hooked = True
            for stage in trainer.strategy.stages:
                stage.register_forward_hook(self._previous_alive)
        self.tracker.__enter__()
        self._active = True

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if not self._active:
            return
        self.tracker.__exit__(None, None, None)
        self._active = False
        if trainer.global_step == self.measured:
            self.peak = self.tracker.peak[0]
            self._previous = []
            stages = trainer.strategy.stages
            forwards = CHUNKS * len(stages)
            self.recomputes = sum(s.forward_calls for s in stages) - self._calls - forwards


def train_one(name: str, schedule: str, mode: str) -> Dict[str, Any]:
    v = SCHEDULES[schedule]
    strategy = PipelineStrategy(
        engine="distributed",
        stages=RANKS * v,
        virtual_stages=v,
        chunks=CHUNKS,
        schedule=schedule,
        checkpoint=mode,
    )
    windows = StepWindows(measured=1)
    trainer = L.Trainer(
        strategy=strategy,
        devices=RANKS,
        max_steps=2,
        callbacks=[windows],
        **QUIET_CPU,
    )
    x, y = data(name, 2)
    trainer.fit(build(name), DataLoader(TensorDataset(x, y), batch_size=MODELS[name]["batch"]))
    plan = strategy.plan
    assert plan is not None
    return {
        "model": name,
        "schedule": schedule,
        "mode": mode,
        "rank": dist.get_rank(),
        "stages": [s.index for s in strategy.stages],
        "balance": list(plan.balance),
        "peak": windows.peak,
        "recomputes": windows.recomputes,
        "previous_grads": windows.previous_grads,
        "order": windows.order,
        "param_bytes": sum(  # every parameter the rank holds, frozen ones too
            p.numel() * p.element_size() for s in strategy.stages for p in s.parameters()
        ),
    }


def worker(spec_path: str) -> None:
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    # Lightning finds this process group already up and keeps it.
    dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=RANKS)
    results = [train_one(*run) for run in spec["runs"]]
    with open(os.path.join(spec["out"], f"rank{os.environ['LOCAL_RANK']}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def launch(todo: List[Tuple[str, str, str]], *, timeout: float) -> List[Dict[str, Any]]:
    """Both ranks started here, as torchrun would; killed, with their children, whatever happens."""
    return run_ranks(__file__, RANKS, {"runs": todo}, timeout=timeout)


# -- predictions and the table -------------------------------------------------------


def predictions(results: List[Dict[str, Any]]) -> Dict[Tuple[str, str, str, int], int]:
    """Predicted act+grad bytes of each (model, schedule, mode, rank) the memory model covers."""
    out: Dict[Tuple[str, str, str, int], int] = {}
    profiles: Dict[str, Any] = {}
    for r in results:
        name, schedule, mode = r["model"], r["schedule"], r["mode"]
        if schedule not in PREDICTED + LOOPED:
            continue
        if name not in profiles:
            model = build(name)
            x, y = data(name, 1)
            size = MODELS[name]["batch"] // CHUNKS
            profiles[name] = profile(model.layers, x[:size], loss_fn=loss_of(name), target=y[:size])
        balance = tuple(r["balance"])
        plan = StagePlan(
            balance=balance,
            devices=(torch.device("cpu"),) * len(balance),
            modes=parse_modes(mode, len(balance)),
        )
        if schedule in LOOPED:
            order = [tuple(op) for op in r["order"]]
            device = predict_device(profiles[name], plan, chunks=CHUNKS, order=order, optimizer="adamw")
            out[(name, schedule, mode, r["rank"])] = device.peak - device.params - device.optimizer
            continue
        (stage,) = r["stages"]
        one = predict(profiles[name], plan, chunks=CHUNKS, optimizer="adamw", schedule=schedule).stages[stage]
        out[(name, schedule, mode, r["rank"])] = one.peak - one.params - one.optimizer
    return out


def table(results: List[Dict[str, Any]], predicted: Dict[Tuple[str, str, str, int], int]) -> List[str]:
    lines = [
        "| model | schedule | mode | rank (stages) | peak MiB | previous .grad MiB | own peak MiB "
        "| recomputes | predicted MiB | error % |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    key = {run: k for k, run in enumerate(runs(list(MODELS), list(SCHEDULES), MODES))}
    ordered = sorted(results, key=lambda r: (key[(r["model"], r["schedule"], r["mode"])], r["rank"]))
    for r in ordered:
        guess = predicted.get((r["model"], r["schedule"], r["mode"], r["rank"]))
        own = r["peak"] - r["previous_grads"]
        cells = [
            r["model"],
            r["schedule"],
            r["mode"],
            f"{r['rank']} ({', '.join(map(str, r['stages']))})",
            f"{r['peak'] / MiB:.2f}",
            f"{r['previous_grads'] / MiB:.2f}",
            f"{own / MiB:.2f}",
            str(r["recomputes"]),
            "-" if guess is None else f"{guess / MiB:.2f}",
            "-" if guess is None else f"{100 * (guess - own) / own:+.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(results: List[Dict[str, Any]], elapsed: float, command: str) -> str:
    described = "; ".join(
        f"`{'GPT' if n == 'gpt' else 'MLP'}({', '.join(f'{k}={v}' for k, v in m['kwargs'].items())})` "
        f"batch {m['batch']}"
        for n, m in MODELS.items()
        if any(r["model"] == n for r in results)
    )
    lines = [
        "## Distributed engine: per-rank memory and recomputes by schedule and mode",
        "",
        f"Machine: {machine()}. Two gloo processes, one torch thread each. Wall time "
        f"{elapsed / 60:.1f} min. Command: `{command}`.",
        f"Models: {described}; fp32, AdamW, {CHUNKS} micro-batches, balance by parameters. One "
        "stage per rank (GPipe, 1F1B) or two (looped schedules); zero-bubble schedules with "
        "`never` only.",
        "",
        "Peak = the most bytes alive at once during the second training step of the storages that "
        "operators created inside the training steps (activations, the step's gradients, recompute "
        "working set, the schedule's receive buffers and pending sends, and any of the previous "
        "step's `.grad` still alive); parameters, optimizer state and the batch are not counted. "
        "Previous .grad = the most bytes of the first step's gradients alive while the schedule "
        "runs: this engine's forward and backward run inside `training_step`, before Lightning "
        "zeroes `.grad`, so at the first batch of an accumulation window (every batch here) it "
        "drops them before the schedule. Own peak = peak less those. "
        "Recomputes = runs of the rank's stages beyond one forward per micro-batch. "
        "Predicted = `pipeckpt.memory.predict.predict` (GPipe, 1F1B) or `predict_device` with the rank's "
        "own op order (interleaved, looped BFS; zero-bubble split backward is not modelled) less "
        "parameters and optimizer state, against own peak; error = (predicted - own) / own. "
        "`offload` runs as `always` on CPU.",
        "",
        *table(results, predictions(results)),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="also write the section to this Markdown file")
    parser.add_argument("--json", default=None, help="also write the raw per-rank figures here")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    torch.set_num_threads(1)
    todo = runs(args.models.split(","), args.schedules.split(","), args.modes.split(","))
    began = time.time()
    results = launch(todo, timeout=args.timeout)
    command = "python benchmarks/bench_distributed_memory.py " + " ".join(sys.argv[1:])
    text = report(results, time.time() - began, command.strip())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
