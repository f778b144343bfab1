"""A user's own LightningModule and LightningDataModule, as one writes them for one device, for the
configs' ``model=custom`` and ``data=custom``: Hugging Face's ``GPT2LMHeadModel`` (nobody here wrote
it) behind a few lines of glue that take ``(inputs, targets)`` batches of token ids, and random such
batches. Not pipeckpt's app classes: the search and train.py must build them from their import paths
and their own arguments alone."""

from typing import Any, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import pipeckpt


class UserGPT2(L.LightningModule):
    def __init__(
        self,
        layers: int = 4,
        width: int = 64,
        heads: int = 4,
        vocab: int = 256,
        positions: int = 128,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=vocab,
            n_positions=positions,
            n_embd=width,
            n_layer=layers,
            n_head=heads,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
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


class UserTokens(L.LightningDataModule):
    """Random token ids, each sample's targets its inputs shifted by one, seeded."""

    def __init__(self, batch_size: int = 16, seq_len: int = 32, vocab: int = 256, samples: int = 256) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size, self.seq_len, self.vocab, self.samples = batch_size, seq_len, vocab, samples

    def _loader(self, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (self.samples, self.seq_len + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(1)
