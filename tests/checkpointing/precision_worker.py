"""What bf16-mixed training does to dtypes, recorded per run: a callback for in-process fits
(tests/checkpointing/test_precision.py) and, run as a script, one rank of a distributed-engine fit.

    python tests/checkpointing/precision_worker.py OUT_DIR CHECKPOINT_MODE

writes ``OUT_DIR/rank<R>.json``: what :class:`DtypeRecorder` saw on that rank.
"""

import json
import os
import sys
from collections import defaultdict
from typing import Any, Dict, List, Set

import lightning as L
import torch
from support.toy import ToyModule, toy_loader
from torch import Tensor, nn
from torchgpipe import is_recomputing

from pipeckpt import PipelineStrategy


class DtypeRecorder(L.Callback):
    """The dtypes of each stage's inputs and outputs, of every Linear's output (in forward and in
    the recompute), of gradients and weights before each optimizer step, and of optimizer state."""

    def __init__(self) -> None:
        self.seen: Dict[str, Set[str]] = defaultdict(set)
        self._handles: List[Any] = []

    def _add(self, what: str, tensor: Any) -> None:
        if isinstance(tensor, Tensor):
            self.seen[what].add(str(tensor.dtype))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for stage in trainer.strategy.stages:
            j = stage.index
            self._handles.append(
                stage.register_forward_pre_hook(lambda m, args, j=j: self._add(f"stage {j} input", args[0]))
            )
            self._handles.append(
                stage.register_forward_hook(lambda m, args, out, j=j: self._add(f"stage {j} output", out))
            )
            for layer in stage.partition.modules():
                if isinstance(layer, nn.Linear):
                    self._handles.append(layer.register_forward_hook(self._matmul))

    def _matmul(self, module: nn.Module, args: Any, out: Tensor) -> None:
        self._add("recomputed Linear output" if is_recomputing() else "Linear output", out)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        for stage in trainer.strategy.stages:
            for p in stage.parameters():
                self._add("gradient", p.grad)
                self._add("weight", p)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        for optimizer in trainer.optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if key != "step":
                        self._add("optimizer state", value)

    def as_lists(self) -> Dict[str, List[str]]:
        return {k: sorted(v) for k, v in self.seen.items()}


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    recorder = DtypeRecorder()
    trainer = L.Trainer(
        strategy=PipelineStrategy(engine="distributed", stages=2, chunks=4, checkpoint=mode),
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        precision="bf16-mixed",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[recorder],
    )
    torch.manual_seed(123)
    trainer.fit(ToyModule(), toy_loader())
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(recorder.as_lists(), f)


if __name__ == "__main__":
    main()
