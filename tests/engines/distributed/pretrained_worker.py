"""One rank of a pretrained fine-tuning run, started by test_pretrained_distributed.py beside it
(see tests/support/ranks.py).

Each run of the spec fine-tunes ``model`` from the pretrained directory ``path`` under
``engine="distributed"`` with ``strategy``: built on the meta device and filled from the directory
(``build='meta'``), or ``from_pretrained`` in every process (``build='eager'``); a ``scratch`` run
builds the model from its config, seeded, on meta or eagerly, with no directory. Each rank saves to
``<run>_rank<r>.pt`` the keys it read from the directory's shards, its stages, and the tensors it
holds for real (an FSDP shard gathered whole) at fit start and after training."""

from pathlib import Path
from typing import Any, Dict

import lightning as L
import torch
from support.pretrained_models import FromPretrained, FromScratch, HeldAtStart, held_whole, keys_read, loader
from support.ranks import quiet_trainer, serve

from pipeckpt import PipelineStrategy


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    L.seed_everything(11)
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    at_start = HeldAtStart()
    trainer = quiet_trainer(strategy, world, max_steps=3, callbacks=[at_start])
    if spec.get("scratch"):
        module: FromPretrained = FromScratch(spec["model"], build=spec["build"])
    else:
        module = FromPretrained(spec["model"], Path(spec["path"]), build=spec["build"])
    with keys_read() as read:
        trainer.fit(module, loader())
    stages = [stage.index for stage in strategy.stages]
    result = dict(read=sorted(read), stages=stages, at_start=at_start.held, trained=held_whole(module.model))
    torch.save(result, Path(out) / f"{spec['name']}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    serve(run)
