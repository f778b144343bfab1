"""One process of tests/engines/distributed/test_recorded_outputs_distributed.py: a MoE model with the
routers' load-balancing loss (tests/support/moe_models.py) under the distributed engine.

Started by tests/support/ranks.py with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set::

    python tests/engines/distributed/recorded_outputs_worker.py SPEC.json

Each run trains ``model`` ("mixtral" or "qwen3_moe") for ``steps`` steps under the run's strategy
settings, writes ``<name>.ckpt`` and ``<name>.rank<r>.json``: the reported step losses, the first
step's gradients of the routers this rank holds, and whether each of the plan's stages recomputes.
"""

import json
import os
from typing import Any, Dict

from support.hf_models import batches
from support.moe_models import MoEModule
from support.ranks import quiet_trainer, serve
from torch.utils.data import DataLoader

from pipeckpt import PipelineStrategy


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    module = MoEModule(spec["model"])
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    trainer = quiet_trainer(strategy, world, max_steps=spec["steps"])
    trainer.fit(module, DataLoader(batches(spec["steps"]), batch_size=None))
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    seen = {
        "step_losses": module.step_losses,
        "routers": {k: g.tolist() for k, g in module.router_grads.items()},
        "checkpoints": [m.checkpoints for m in strategy.plan.modes],  # this process's stages'
    }
    with open(os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    serve(run)
