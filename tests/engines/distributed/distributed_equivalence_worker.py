"""One process of a test run of tests/engines/distributed/test_distributed_equivalence.py (the pattern of
distributed_pytree_worker.py).

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists runs done one after the other in the same processes:

    python tests/engines/distributed/distributed_equivalence_worker.py SPEC.json

Each run builds ``model`` ("tied": tests/support/equivalence_models.py's TiedDropoutModule; "pytree":
PytreeForwardModule; "skips": SkipsModule; "gpt2" / "demo": the clients of examples/, unmodified,
pipelined with pipeline_of) with ``dropout`` under engine="distributed", then either trains it
(``action`` "fit": writes `<name>.ckpt`) or, untrained, validates and predicts (``action``
"forward": rank 0 writes
`<name>.forward.pt` holding the logged ``val_loss`` and every batch's ``predict_step`` output).
"""

import os
from typing import Any, Dict, Tuple

import lightning as L
import torch
from support.equivalence_models import PytreeForwardModule, SkipsModule, TiedDropoutModule, forward_client
from support.pytree_models import pytree_loader, tied_loader
from support.ranks import quiet_trainer, serve
from torch.utils.data import DataLoader

from pipeckpt import PipelineStrategy


def build(spec: Dict[str, Any]) -> Tuple[L.LightningModule, DataLoader]:
    model, dropout = spec["model"], spec.get("dropout", 0.0)
    if model == "tied":
        return TiedDropoutModule(dropout=dropout), tied_loader()
    if model == "skips":
        return SkipsModule(dropout=dropout), pytree_loader()
    if model == "pytree":
        return PytreeForwardModule(dropout=dropout), pytree_loader()
    return forward_client(model, dropout=dropout)


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module, loader = build(spec)
    forward_only = spec.get("action", "fit") == "forward"
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=spec.get("steps", 1),
        limit_val_batches=1.0 if forward_only else 0,
    )
    torch.manual_seed(123)
    if not forward_only:
        trainer.fit(module, loader)
        trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
        return
    trainer.validate(module, loader, verbose=False)
    val_loss = float(trainer.callback_metrics["val_loss"])
    predictions = trainer.predict(module, loader)
    if trainer.global_rank == 0:
        path = os.path.join(out, f"{spec['name']}.forward.pt")
        torch.save({"val_loss": val_loss, "predictions": predictions}, path)


if __name__ == "__main__":
    serve(run)
