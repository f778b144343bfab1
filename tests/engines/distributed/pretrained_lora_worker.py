"""One rank of a LoRA fine-tuning run from a pretrained directory, started by
test_pretrained_lora_distributed.py beside it (see tests/support/ranks.py).

Each run of the spec trains tests/support/pretrained_lora.py's module (built on the meta device, the
base marked pretrained before ``get_peft_model``) 3 steps under ``engine="distributed"`` with
``strategy``, ``HFExport`` writing ``<name>-hf`` when fit ends, then saves the sharded checkpoint
``<name>.ckpt``. Each rank saves to ``<name>_rank<r>.pt`` the tensors it holds for real (an FSDP shard
gathered whole) at fit start and after training."""

from pathlib import Path
from typing import Any, Dict

import lightning as L
import torch
from support.pretrained_lora import LoraFromPretrained
from support.pretrained_models import HeldAtStart, held_whole, loader
from support.ranks import quiet_trainer, serve

from pipeckpt import PipelineStrategy
from pipeckpt.export import HFExport


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    L.seed_everything(11)
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    at_start = HeldAtStart()
    export = HFExport(Path(out) / f"{spec['name']}-hf")
    trainer = quiet_trainer(strategy, world, max_steps=3, callbacks=[at_start, export])
    module = LoraFromPretrained(Path(spec["path"]))
    trainer.fit(module, loader())
    trainer.save_checkpoint(Path(out) / f"{spec['name']}.ckpt")
    result = dict(at_start=at_start.held, trained=held_whole(module.model))
    torch.save(result, Path(out) / f"{spec['name']}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    serve(run)
