"""One process of a test run of tests/engines/distributed/test_distributed_real_models.py (the pattern of
distributed_pytree_worker.py).

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/engines/distributed/distributed_real_models_worker.py SPEC.json

Each run trains ``client`` ("gpt2" or "demo": the LightningModules of examples/, their models
unmodified, pipelined with pipeline_of) under engine="distributed" and writes `<name>.ckpt` and
`<name>.rank<R>.json` (what that rank saw) into the spec's `out` directory.
"""

import json
import os
from typing import Any, Dict

import torch
from support.ranks import quiet_trainer, serve
from support.real_models import client

from pipeckpt import PipelineStrategy


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module, loader = client(spec["client"], dropout=spec.get("dropout", 0.0))
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=spec["steps"],
        gradient_clip_val=spec.get("gradient_clip_val"),
    )
    torch.manual_seed(123)
    trainer.fit(module, loader)
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    seen = {
        "forward_calls": {s.index: s.forward_calls for s in trainer.strategy.stages},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    with open(os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    serve(run)
