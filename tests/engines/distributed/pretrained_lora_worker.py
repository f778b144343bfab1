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
from support.pretrained_models import loader
from support.ranks import quiet_trainer, serve

from pipeckpt import PipelineStrategy
from pipeckpt.export import HFExport


def _real(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in module.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        if not v.is_meta:
            out[k] = v.detach().clone()
    return out


class AtStart(L.Callback):
    def __init__(self) -> None:
        self.held: Dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.held = _real(module.model)


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    L.seed_everything(11)
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    at_start = AtStart()
    export = HFExport(Path(out) / f"{spec['name']}-hf")
    trainer = quiet_trainer(strategy, world, max_steps=3, callbacks=[at_start, export])
    module = LoraFromPretrained(Path(spec["path"]))
    trainer.fit(module, loader())
    trainer.save_checkpoint(Path(out) / f"{spec['name']}.ckpt")
    result = dict(at_start=at_start.held, trained=_real(module.model))
    torch.save(result, Path(out) / f"{spec['name']}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    serve(run)
