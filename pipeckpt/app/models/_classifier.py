"""The training logic shared by the classifier examples (MLP, convnet).

They differ only in their layers, so the steps, metrics and optimizer live here
once; each subclass builds ``self.layers`` and nothing else.
"""

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

__all__: list[str] = []


class Classifier(L.LightningModule):
    """Cross-entropy classification with a pipelined ``self.layers``."""

    layers: nn.Sequential

    def __init__(self, *, lr: float, weight_decay: float) -> None:
        super().__init__()
        # Typed copies for configure_optimizers: hparams is an untyped mapping.
        self.lr = lr
        self.weight_decay = weight_decay

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layers(inputs)

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss on the pipeline's output (``checkpoint='auto'`` profiles its memory too)."""
        return F.cross_entropy(logits, labels)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        inputs, labels = batch
        logits = self.layers(inputs)
        loss = self.pipeline_loss(logits, labels)
        self.log(f"{stage}_loss", loss, prog_bar=True)
        self.log(f"{stage}_acc", (logits.argmax(dim=1) == labels).float().mean())
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val")

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
