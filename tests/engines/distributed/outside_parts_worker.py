"""One process of tests/engines/distributed/test_outside_parts_distributed.py (the pattern of
distributed_pytree_worker.py): each run of the spec trains ``model`` (tests/support/vocab_models.py)
under ``engine="distributed"`` with ``strategy`` for 3 steps and writes ``<name>.rank<R>.pt``: the
bytes of the parameters the rank holds when the fit starts (an FSDP shard's local bytes) and their
local shapes, its step losses, and the
tensors it holds after training, whole (a shard gathered); and the run's checkpoint, ``<name>.ckpt``."""

from pathlib import Path
from typing import Any, Dict

import lightning as L
import torch
from support.pretrained_models import held_whole
from support.ranks import quiet_trainer, serve
from support.vocab_models import Losses, VocabModule, loader
from torch.distributed.tensor import DTensor

from pipeckpt import PipelineStrategy


class _HeldBytes(L.Callback):
    def on_train_start(self, trainer: Any, module: Any) -> None:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters() if not p.is_meta]
        self.bytes = sum(p.numel() * p.element_size() for p in local)
        named = [(n, p) for n, p in module.model.named_parameters() if not p.is_meta]
        self.shapes = {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in named}


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module = VocabModule(spec["model"])
    module.reads_logits = bool(spec.get("reads_logits"))
    held, losses = _HeldBytes(), Losses()
    validate = bool(spec.get("validate"))  # at the epoch's end, after the 3 steps: its outputs whole
    options: Dict[str, Any] = dict(limit_val_batches=3) if validate else {}
    trainer = quiet_trainer(strategy, world, max_steps=3, callbacks=[held, losses], **options)
    trainer.fit(module, loader(spec["model"]), loader(spec["model"]) if validate else None)
    trainer.save_checkpoint(str(Path(out) / f"{spec['name']}.ckpt"))
    seen = getattr(module, "logits_seen", None)  # the last stage's step alone reaches the logits
    validated = trainer.callback_metrics.get("val_loss")
    result = dict(
        held_bytes=held.bytes,
        local_shapes=held.shapes,
        losses=losses.losses,
        logits_seen=seen,
        val_loss=None if validated is None else float(validated),
        trained=held_whole(module.model),
    )
    torch.save(result, Path(out) / f"{spec['name']}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    serve(run)
