"""One process of a test run of tests/engines/distributed/test_distributed_pytree.py (the pattern of
distributed_worker.py).

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/engines/distributed/distributed_pytree_worker.py SPEC.json

Each run trains ``model`` ("pytree" or "tied", tests/support/pytree_models.py) and writes `<name>.ckpt` and
`<name>.rank<R>.json` (what that rank saw) into the spec's `out` directory. `perturb_tie`: every rank but
0 adds 1 to its copy of the tied weight before training (the copies must start equal all the same).
"""

import json
import os
from typing import Any, Dict

import torch
from support.pytree_models import PytreeModule, TiedModule, pytree_loader, tied_loader
from support.ranks import quiet_trainer, serve

from pipeckpt import PipelineStrategy


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    tied = spec["model"] == "tied"
    module = TiedModule() if tied else PytreeModule(dropout=spec.get("dropout", 0.0))
    if spec.get("perturb_tie") and int(os.environ["LOCAL_RANK"]) != 0:
        with torch.no_grad():
            module.layers[0].weight.add_(1.0)
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=spec["steps"],
        limit_val_batches=1.0 if spec.get("validate") else 0,
        accumulate_grad_batches=spec.get("accumulate_grad_batches", 1),
        gradient_clip_val=spec.get("gradient_clip_val"),
    )
    torch.manual_seed(123)
    loader = tied_loader() if tied else pytree_loader()
    trainer.fit(module, loader)
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    seen = {
        "forward_calls": {s.index: s.forward_calls for s in trainer.strategy.stages},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    if spec.get("validate"):
        trainer.validate(module, loader, verbose=False)
        seen["metrics"].update({k: float(v) for k, v in trainer.callback_metrics.items()})
    with open(os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    serve(run)
