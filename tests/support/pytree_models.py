"""Modules for the distributed engine's pytree, side-input and tied-weight tests
(tests/engines/distributed/test_distributed_pytree.py, run in processes by
tests/engines/distributed/distributed_pytree_worker.py).

- :class:`PytreeModule`: its layers pass dicts and tuples holding ``None``, ints, strings and
  several tensors that all carry gradient, and two of them take a side input (``mask=``) that
  ``training_step`` computes from the batch;
- :class:`TiedModule`: a token embedding on the first stage whose weight is also the LM head's on
  the last stage (tied), as in GPT-2.
"""

from typing import Any, Dict, Optional, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class Split(nn.Module):
    """x -> a dict: two tensors that both carry gradient, and non-tensor leaves."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, width), nn.Linear(8, width)

    def forward(self, x: Tensor) -> Dict[str, Any]:
        return {"h": self.a(x), "g": self.b(x), "n": 3, "tag": "split", "none": None}


class Masked(nn.Module):
    """A dict in, the same dict out; takes the side input ``mask``."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear, self.drop = nn.Linear(width, width), nn.Dropout(dropout)

    def forward(self, state: Dict[str, Any], mask: Optional[Tensor] = None) -> Dict[str, Any]:
        h = self.drop(torch.tanh(self.linear(state["h"]) + state["g"]))
        if mask is not None:
            h = h * mask[:, None]
        return dict(state, h=h)


class ToTuple(nn.Module):
    """A dict in, a tuple with ``None`` and an int out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, state: Dict[str, Any]) -> Tuple[Any, ...]:
        assert state["n"] == 3 and state["tag"] == "split" and state["none"] is None
        return (self.linear(state["h"]), None, state["g"], state["n"])


class Head(nn.Module):
    """A tuple in, a dict out (logits and a string)."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, classes)

    def forward(self, state: Tuple[Any, ...], mask: Optional[Tensor] = None) -> Dict[str, Any]:
        h, nothing, g, n = state
        assert nothing is None and n == 3
        out = self.linear(torch.tanh(h) * g.sigmoid())
        if mask is not None:
            out = out * mask[:, None]
        return {"logits": out, "kind": "logits"}


class TupleMasked(nn.Module):
    """A tuple in, the same tuple out; takes the side input ``mask``."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear, self.drop = nn.Linear(width, width), nn.Dropout(dropout)

    def forward(self, state: Tuple[Any, ...], mask: Optional[Tensor] = None) -> Tuple[Any, ...]:
        h, nothing, g, n = state
        h = self.drop(torch.tanh(self.linear(h)))
        if mask is not None:
            h = h * mask[:, None]
        return (h, nothing, g, n)


def pytree_layers(*, width: int = 16, dropout: float = 0.0, classes: int = 3) -> nn.Sequential:
    return nn.Sequential(
        Split(width),
        Masked(width, dropout),
        ToTuple(width),
        TupleMasked(width, dropout),
        Head(width, classes),
    )


class PytreeModule(L.LightningModule):
    def __init__(self, *, dropout: float = 0.0, lr: float = 0.05, seed: int = 0) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(seed)
        self.layers = pytree_layers(dropout=dropout)

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        mask = (x[:, 0] > -1.0).float()  # a side input computed in the step
        out = self.layers(x, mask=mask)
        assert out["kind"] == "logits"
        loss = F.cross_entropy(out["logits"], y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        out = self.layers(x, mask=(x[:, 0] > -1.0).float())
        self.log("val_loss", F.cross_entropy(out["logits"], y))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class TiedHead(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding  # the same module, so the same weight

    def forward(self, h: Tensor) -> Tensor:
        return h @ self.embedding.weight.t()


VOCAB = 11


def tied_layers() -> nn.Sequential:
    embedding = nn.Embedding(VOCAB, 8)
    return nn.Sequential(embedding, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), TiedHead(embedding))


class TiedModule(L.LightningModule):
    def __init__(self, *, lr: float = 0.05, seed: int = 0) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(seed)
        self.layers = tied_layers()

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, targets = batch
        logits = self.layers(tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def pytree_loader(*, n: int = 64, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)),
        batch_size=batch_size,
        shuffle=False,
    )


def tied_loader(*, n: int = 64, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (n, 5), generator=g)
    return DataLoader(TensorDataset(tokens, tokens.roll(-1, dims=1)), batch_size=batch_size, shuffle=False)
