"""One process of tests/engines/distributed/test_frozen_distributed.py: ``checkpoint="auto"`` on models
with frozen parameters under the distributed engine.

Started by tests/support/ranks.py with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set::

    python tests/engines/distributed/distributed_frozen_worker.py SPEC.json

Each run trains ``model`` ("toy": the toy Sequential with a frozen block; "lora": PEFT LoRA on a tiny
Llama, tests/support/frozen_models.py) under ``PipelineStrategy(engine="distributed",
checkpoint="auto", ...)``, writes ``<name>.ckpt`` and, from rank 0, ``<name>.json``: the modes built.
"""

import json
import os
from typing import Any, Dict

from support.frozen_models import LoraLlama, frozen_toy, lora_loader
from support.ranks import quiet_trainer, serve
from support.toy import toy_loader

from pipeckpt import PipelineStrategy


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", checkpoint="auto", **spec["strategy"])
    module, loader = (frozen_toy(), toy_loader()) if spec["model"] == "toy" else (LoraLlama(), lora_loader())
    trainer = quiet_trainer(strategy, world, max_steps=spec["steps"])
    trainer.fit(module, loader)
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    if trainer.global_rank == 0:
        assert strategy.plan is not None
        with open(os.path.join(out, f"{spec['name']}.json"), "w") as f:
            json.dump({"modes": [m.name for m in strategy.plan.modes]}, f)


if __name__ == "__main__":
    serve(run)
