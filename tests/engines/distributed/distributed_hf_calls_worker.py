"""One process of a test run of tests/engines/distributed/test_hf_calls_distributed.py (the pattern of
distributed_real_models_worker.py).

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/engines/distributed/distributed_hf_calls_worker.py SPEC.json

Each run trains ``model`` ("gpt2" or "llama", tests/support/hf_models.py) with the training step
``step`` (one HF call: ``self.model(**batch).loss`` or keyword-only) under engine="distributed" and
writes `<name>.ckpt` into the spec's `out` directory.
"""

import os
from typing import Any, Dict

from support.hf_models import STEPS, HFModule, batches
from support.ranks import quiet_trainer, serve
from torch.utils.data import DataLoader

from pipeckpt import PipelineStrategy


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module = HFModule(spec["model"], STEPS[spec["step"]])
    trainer = quiet_trainer(strategy, world, max_steps=spec["steps"])
    trainer.fit(module, DataLoader(batches(), batch_size=None))
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))


if __name__ == "__main__":
    serve(run)
