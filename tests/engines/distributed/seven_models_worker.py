"""One process of the distributed runs of tests/engines/test_seven_models.py (the pattern of
distributed_real_models_worker.py).

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/engines/distributed/seven_models_worker.py SPEC.json

Each run trains ``model`` (tests/support/seven_models.py) under engine="distributed" and writes
`<name>.ckpt` into the spec's `out` directory.
"""

import os
from typing import Any, Dict

import torch
from support.ranks import quiet_trainer, serve
from support.seven_models import model_and_data

from pipeckpt import PipelineStrategy


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module, data = model_and_data(spec["model"], dropout=spec["dropout"])
    trainer = quiet_trainer(strategy, world, max_steps=spec["steps"])
    torch.manual_seed(123)  # as the local run seeds, after building the model
    trainer.fit(module, data)
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))


if __name__ == "__main__":
    serve(run)
