"""One rank of tests/memory/test_meta_auto_distributed.py (started by tests/support/ranks.py):
``checkpoint="auto"`` under ``engine="distributed"`` on a tiny Hugging Face model built on the meta
device in ``configure_model`` (``build='meta'``) or eagerly in ``__init__`` (``build='eager'``).

Each run trains 3 steps and writes ``<name>.rank<R>.pt``: the plan rank 0 chose and the plan this
rank built, the predicted peak of its stage, its memory in the second step as
benchmarks/bench_distributed_memory.py measures it (its ``StepWindows``: storages made inside the
step's window) plus what the window leaves out and the budget counts (this rank's parameters and
optimizer state), and the tensors it holds for real after training."""

from pathlib import Path
from typing import Any, Dict

import lightning as L
import torch
from bench_distributed_memory import StepWindows  # the benchmark's own measurement
from support.pretrained_models import FromPretrained, FromScratch, loader
from support.ranks import quiet_trainer, serve
from torch import Tensor

from pipeckpt import PipelineStrategy


def _bytes(tensors: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, Tensor))


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    L.seed_everything(11)
    strategy = PipelineStrategy(engine="distributed", checkpoint="auto", **spec["strategy"])
    windows = StepWindows(measured=1)
    trainer = quiet_trainer(strategy, world, max_steps=3, callbacks=[windows])
    if spec.get("path"):
        module: FromPretrained = FromPretrained(spec["model"], Path(spec["path"]), build=spec["build"])
    else:
        module = FromScratch(spec["model"], build=spec["build"])
    trainer.fit(module, loader())
    auto, plan = strategy.auto_plan, strategy.plan
    assert auto is not None and plan is not None
    mine = [s.index for s in strategy.stages]
    params = [p for s in strategy.stages for p in s.parameters()]
    ids = {id(p) for p in params}
    state = [t for p, st in trainer.optimizers[0].state.items() if id(p) in ids for t in st.values()]
    seen = {
        "rank": trainer.global_rank,
        "stages": mine,
        "chosen": [[m.name for m in auto.choice.modes], auto.choice.chunks, list(auto.choice.balance)],
        "built": [[m.name for m in plan.modes], strategy.settings.chunks, list(plan.balance)],
        "budget": auto.budget,
        "predicted": [auto.choice.prediction.stages[j].peak for j in mine],
        "window_peak": windows.peak,
        "held": _bytes(params) + _bytes(state),
        "steps": trainer.global_step,
        "trained": {k: v.detach().clone() for k, v in module.model.state_dict().items() if not v.is_meta},
    }
    torch.save(seen, Path(out) / f"{spec['name']}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    serve(run)
