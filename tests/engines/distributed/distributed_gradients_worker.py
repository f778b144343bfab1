"""One rank of tests/engines/distributed/test_distributed_gradients.py: the toy module trained under
gradient accumulation
by the distributed engine, with a probe of the previous step's gradients still alive while the
schedule runs.

    python tests/engines/distributed/distributed_gradients_worker.py SPEC.json

A run writes ``<name>.ckpt`` (a sharded directory) and ``<name>.rank<R>.json``: per batch
(``"epoch:index"``),
the bytes of the ``.grad`` tensors that existed when the batch started and are still alive at
the last forward of one of this rank's stages in that batch (the schedule's forwards run after
the previous step's gradients were dropped or set aside, and before the strategy's backward).
"""

import json
import os
import weakref
from typing import Any, Dict, List

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support.ranks import quiet_trainer, serve
from support.toy import ToyModule, toy_loader

from pipeckpt import PipelineStrategy


class SGDKeepingTensors(torch.optim.SGD):
    """Zeroes gradients in place (``set_to_none=False``), as older optimizers do."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none=False)


class ZeroingModule(ToyModule):
    """The toy module, optionally with SGD that zeroes in place."""

    def __init__(self, *, in_place_zero: bool = False) -> None:
        super().__init__()
        self.in_place_zero = in_place_zero

    def configure_optimizers(self) -> Any:
        if self.in_place_zero:
            return SGDKeepingTensors(self.parameters(), lr=0.1, momentum=0.9)
        return super().configure_optimizers()


class OwnZeroGrad(ToyModule):
    """Lightning's zeroing, but in the module's own ``optimizer_zero_grad``: the engine cannot know it."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)


class HeldGradients(L.Callback):
    """Per batch index: bytes of the gradients that were in ``.grad`` at the batch's start and are
    still alive during the schedule (the most seen at any forward of this rank's stages)."""

    def __init__(self) -> None:
        self.refs: List[Any] = []
        self.held: Dict[str, int] = {}
        self.at = ""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for stage in trainer.strategy.stages:
            stage.register_forward_hook(self._seen)

    def on_train_batch_start(
        self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        self.at = f"{trainer.current_epoch}:{idx}"
        self.refs = [
            (weakref.ref(p.grad), p.grad.untyped_storage().nbytes())
            for p in module.parameters()
            if p.grad is not None
        ]
        self.held[self.at] = 0

    def _seen(self, *_: Any) -> None:
        alive = sum(n for ref, n in self.refs if ref() is not None)
        self.held[self.at] = max(self.held[self.at], alive)


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module = OwnZeroGrad() if spec.get("own_zero_grad") else ZeroingModule(**spec.get("module", {}))
    probe = HeldGradients()
    callbacks: List[L.Callback] = [probe]
    if "checkpoint_every" in spec:
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(out, spec["name"]),
                every_n_train_steps=spec["checkpoint_every"],
                save_top_k=-1,
            )
        )
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=spec["steps"],
        enable_checkpointing="checkpoint_every" in spec,
        callbacks=callbacks,
        accumulate_grad_batches=spec["accumulate_grad_batches"],
        gradient_clip_val=spec.get("gradient_clip_val"),
    )
    torch.manual_seed(123)
    resume = os.path.join(out, spec["resume_from"]) if "resume_from" in spec else None
    trainer.fit(module, toy_loader(), ckpt_path=resume)
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    with open(os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"held": probe.held}, f)


if __name__ == "__main__":
    serve(run)
