"""A user's own LightningModule, as one writes it for one device, for the configs' ``model=custom``:
Hugging Face's ``GPT2LMHeadModel`` (nobody here wrote it) behind a few lines of glue that take the
bundled text's ``(inputs, targets)`` batches. Not one of pipeckpt's app models: the search and
train.py must build it from its import path and its own arguments alone."""

from typing import Any, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GPT2Config, GPT2LMHeadModel

import pipeckpt


class UserGPT2(L.LightningModule):
    def __init__(
        self, layers: int = 4, width: int = 64, heads: int = 4, vocab: int = 256, positions: int = 128
    ):
        super().__init__()
        config = GPT2Config(
            vocab_size=vocab,
            n_positions=positions,
            n_embd=width,
            n_layer=layers,
            n_head=heads,
            use_cache=False,
        )
        self.model = GPT2LMHeadModel(config)

    def configure_pipeline(self) -> Any:
        return pipeckpt.pipeline_of(self.model, "transformer.h")

    def _loss(self, batch: Tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        return F.cross_entropy(self.model(inputs).logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
