"""One process of tests/engines/distributed/test_distributed_zero_bubble.py's matrix (the pattern of
distributed_pytree_worker.py): every schedule under every checkpoint mode, on three models.

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/engines/distributed/distributed_zero_bubble_worker.py SPEC.json

Each run trains ``model`` ("tensor": tests/support/toy.py's ToyModule, on ``samples`` samples;
"pytree": tests/support/pytree_models.py's PytreeModule, a side input; "rooted": Lightning's demo
Transformer through ``pipeline_of``) and writes `<name>.rank<R>.pt`: the parameters this rank holds
(not on the meta device), each of its stages' ``forward_calls`` and how many parameter gradients
were added to ``.grad`` inside the schedule's weight passes and outside them.
"""

import os
from typing import Any, Dict, Tuple

import lightning as L
import torch
from support.pytree_models import PytreeModule, pytree_loader
from support.ranks import quiet_trainer, serve
from support.real_models import client
from support.toy import ToyModule, toy_loader
from torch.utils.data import DataLoader

from pipeckpt import PipelineStrategy
from pipeckpt.engines.distributed.wiring import LiveStage

_weight_pass = LiveStage.backward_weight_one_chunk
_in_weight_pass = [False]


def _marking(self: LiveStage, *args: Any, **kwargs: Any) -> Any:
    _in_weight_pass[0] = True
    try:
        return _weight_pass(self, *args, **kwargs)
    finally:
        _in_weight_pass[0] = False


LiveStage.backward_weight_one_chunk = _marking  # type: ignore[method-assign]


def build(model: str, samples: int = 64) -> Tuple[L.LightningModule, DataLoader]:
    """``samples``: the tensor model's data (batches of 16; the last one shorter where 16 does not
    divide it)."""
    if model == "tensor":
        return ToyModule(), toy_loader(n=samples)
    if model == "pytree":
        return PytreeModule(), pytree_loader()
    return client("demo")


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    module, loader = build(spec["model"], spec.get("samples", 64))
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    trainer = quiet_trainer(strategy, world, max_steps=spec["steps"], limit_val_batches=0)
    added = {"weight": 0, "input": 0}

    def count(p: torch.Tensor) -> None:
        added["weight" if _in_weight_pass[0] else "input"] += 1

    for p in module.parameters():
        p.register_post_accumulate_grad_hook(count)
    torch.manual_seed(123)
    trainer.fit(module, loader)
    held = {k: v.detach().clone() for k, v in module.state_dict().items() if not v.is_meta}
    calls = {s.index: s.forward_calls for s in trainer.strategy.stages}
    path = os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.pt")
    torch.save({"params": held, "forward_calls": calls, "added": added}, path)


if __name__ == "__main__":
    serve(run)
