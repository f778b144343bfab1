"""Modules of the dropout-equivalence tests (tests/checkpointing/test_dropout_equivalence.py, local engine,
and
tests/engines/distributed/test_distributed_equivalence.py, run in processes by
tests/engines/distributed/distributed_equivalence_worker.py):
the models of tests/support/pytree_models.py and the two real clients (tests/support/real_models.py), with
dropout
where they had none, and with the forward-only hooks (validation_step, predict_step) a user writes.

- :class:`TiedDropoutModule`: :class:`~pytree_models.TiedModule` (an embedding tied to the LM head on
  the last stage) with a dropout in its middle layer;
- :class:`PytreeForwardModule`: :class:`~pytree_models.PytreeModule` whose ``predict_step`` returns
  the pipeline's whole dict output;
- :class:`Skips` / :class:`SkipsModule`: a model with its own forward whose first block's output is
  read again by the last block (a skip from the first stage to the last), pipelined with ``pipeline_of``;
- :func:`forward_client`: the demo Transformer's / GPT-2's LightningModule with a ``validation_step``
  and a ``predict_step`` (log-probabilities / logits of the whole batch).
"""

import inspect
from typing import Any, Dict, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from pipeckpt import pipeline_of
from support.pytree_models import PytreeModule, TiedModule
from support.real_models import client


class TiedDropoutModule(TiedModule):
    """The tied model, its third layer ``Tanh`` preceded by a dropout (same parameters, same keys)."""

    def __init__(self, *, dropout: float = 0.3, lr: float = 0.05, seed: int = 0) -> None:
        super().__init__(lr=lr, seed=seed)
        self.layers[2] = nn.Sequential(nn.Dropout(dropout), nn.Tanh())


def plain_pytree(layers: nn.Sequential, x: Tensor, mask: Tensor) -> Dict[str, Any]:
    """``PytreeModule``'s layers run unpipelined: ``mask=`` handed to each layer that declares it
    (an ``nn.Sequential`` takes no keywords, which is what the pipeline adds)."""
    h: Any = x
    for layer in layers:
        h = layer(h, mask=mask) if "mask" in inspect.signature(layer.forward).parameters else layer(h)
    return h


def pytree_mask(x: Tensor) -> Tensor:
    return (x[:, 0] > -1.0).float()  # as PytreeModule.training_step computes it


class PytreeForwardModule(PytreeModule):
    def predict_step(self, batch: Any, batch_idx: int) -> Dict[str, Any]:
        x, _ = batch
        return self.layers(x, mask=pytree_mask(x))  # the whole pytree: logits and a string


class Skips(nn.Module):
    """A U-Net-like model with its own forward: block 0's output is read again by block 3 (a skip from
    the first stage to the last) and block 1's by block 2; dropout inside the blocks and outside them."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.drop = nn.Dropout(dropout)  # outside the named layers
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Dropout(dropout), nn.Tanh()) for _ in range(4)
        )
        self.out = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        h0 = self.blocks[0](self.drop(self.inp(x)))
        h1 = self.blocks[1](h0)
        h2 = self.blocks[2](h1) + h1
        return self.out(self.blocks[3](h2) + h0)


class SkipsModule(L.LightningModule):
    """:class:`Skips` pipelined with ``pipeline_of``, block by block."""

    def __init__(self, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.model = Skips(dropout)

    def configure_pipeline(self) -> Any:
        return pipeline_of(self.model, "blocks")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def forward_client(name: str, *, dropout: float = 0.0) -> Tuple[L.LightningModule, DataLoader]:
    """The client's module (weights from seed 0) with ``validation_step`` (``val_loss``) and a
    ``predict_step`` returning the model's output on the batch."""
    module, loader = client(name, dropout=dropout)

    class Forward(type(module)):  # type: ignore[misc]
        def _output(self, batch: Any) -> Tensor:
            if name == "gpt2":
                ids, mask = batch
                return self.model(ids, attention_mask=mask).logits
            inputs, target = batch
            return self.model(inputs, target)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", reference_loss(name, batch, self._output(batch)))

        def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
            return self._output(batch)

    module.__class__ = Forward
    return module, loader


def reference_loss(name: str, batch: Any, output: Tensor) -> Tensor:
    """The validation loss from the model's output: a mean over the batch's samples."""
    if name == "gpt2":
        ids, mask = batch
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        flat = output[:, :-1].flatten(0, 1)
        return F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="sum") / labels.numel()
    _, target = batch
    return F.nll_loss(output, target.flatten())


def unpipelined_outputs(name: str, module: L.LightningModule, loader: DataLoader) -> Tuple[list, list]:
    """Per batch: the validation loss and the predict output of ``module`` run unpipelined, eval mode."""
    module.eval()
    losses, outputs = [], []
    with torch.no_grad():
        for batch in loader:
            if name == "pytree":
                x, y = batch
                out = plain_pytree(module.layers, x, pytree_mask(x))
                losses.append(F.cross_entropy(out["logits"], y))
                outputs.append(out)
            else:
                out = module._output(batch)
                losses.append(reference_loss(name, batch, out))
                outputs.append(out)
    return losses, outputs
