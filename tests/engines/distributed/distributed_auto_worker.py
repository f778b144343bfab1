"""One process of tests/engines/distributed/test_distributed_auto.py: ``checkpoint="auto"`` under the
distributed engine.

Started by tests/support/ranks.py with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set::

    python tests/engines/distributed/distributed_auto_worker.py SPEC.json

Each run of the spec trains a small GPT for two steps under ``PipelineStrategy(engine="distributed",
checkpoint="auto", ...)`` and writes ``<name>.rank<R>.json``: the plan this rank built, the plan
it was told was chosen, and its memory in the second step, measured as
benchmarks/bench_distributed_memory.py measures it (its ``StepWindows``: storages created inside
the step's window, the previous step's ``.grad`` included) plus what the window leaves out and the
budget counts: this rank's parameters and optimizer state. Rank 0 also writes the profiles the
choice was made from (``<name>.profiles.pt``). A configuration error is not caught: the process
exits with it, as a user's would.
"""

import json
import os
from typing import Any, Dict

import torch
from bench_distributed_memory import StepWindows  # the benchmark's own measurement
from support.ranks import quiet_trainer, serve
from torch import Tensor

from pipeckpt import PipelineStrategy
from pipeckpt.app.data import SyntheticTokens
from pipeckpt.app.models import GPT

#: The model and data every run uses (the test builds the same ones to compare the choice).
GPT_KWARGS: Dict[str, Any] = dict(size="tiny", n_layers=4, seq_len=64, vocab_size=256, dropout=0.1)
DATA_KWARGS: Dict[str, Any] = dict(seq_len=64, vocab_size=256, num_samples=64, val_samples=16, batch_size=16)


def build() -> tuple[GPT, SyntheticTokens]:
    torch.manual_seed(0)
    return GPT(**GPT_KWARGS), SyntheticTokens(**DATA_KWARGS, seed=0)


def _bytes(tensors: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, Tensor))


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", checkpoint="auto", **spec["strategy"])
    windows = StepWindows(measured=1)
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=2,
        callbacks=[windows],
    )
    model, data = build()
    trainer.fit(model, data)
    auto, plan = strategy.auto_plan, strategy.plan
    assert auto is not None and plan is not None
    mine = [s.index for s in strategy.stages]
    params = [p for s in strategy.stages for p in s.parameters()]
    ids = {id(p) for p in params}
    optimizer = trainer.optimizers[0]
    state = [t for p, st in optimizer.state.items() if id(p) in ids for t in st.values()]
    seen = {
        "rank": trainer.global_rank,
        "stages": mine,
        "chosen": {
            "modes": [m.name for m in auto.choice.modes],
            "chunks": auto.choice.chunks,
            "balance": list(auto.choice.balance),
        },
        "built": {
            "modes": [m.name for m in plan.modes],
            "chunks": strategy.settings.chunks,
            "balance": list(plan.balance),
        },
        "budget": auto.budget,
        "predicted": [auto.choice.prediction.stages[j].peak for j in mine],
        "window_peak": windows.peak,
        "params": _bytes(params),
        "optimizer": _bytes(state),
        "steps": trainer.global_step,
    }
    with open(os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(seen, f)
    if trainer.global_rank == 0:
        torch.save(auto.profiles, os.path.join(out, f"{spec['name']}.profiles.pt"))


if __name__ == "__main__":
    serve(run)
