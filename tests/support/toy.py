"""A small LightningModule and data shared by the core tests: a stack of
Linear layers (optionally with dropout) exposed through configure_pipeline()."""

from typing import Any, Dict, List

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from support.trainers import QUIET


class Counter(nn.Module):
    """Counts its forward calls; recomputation counts too."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x


class DtypeProbe(nn.Module):
    """Records the dtype of the tensor that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[torch.dtype] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.dtype)
        return x


def toy_layers(
    *, width: int = 16, depth: int = 6, dropout: float = 0.0, classes: int = 3, batch_norm: bool = False
) -> nn.Sequential:
    """``batch_norm``: a BatchNorm1d after each middle block's Tanh (not straight after a Linear,
    whose bias would get a zero gradient that Adam turns into steps of pure rounding noise)."""
    layers: List[nn.Module] = [nn.Linear(8, width)]
    for _ in range(depth - 2):
        norm: List[nn.Module] = [nn.BatchNorm1d(width)] if batch_norm else []
        layers.append(nn.Sequential(nn.Tanh(), *norm, nn.Dropout(dropout), nn.Linear(width, width)))
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class ToyModule(L.LightningModule):
    def __init__(
        self,
        *,
        depth: int = 6,
        dropout: float = 0.0,
        lr: float = 0.05,
        seed: int = 0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.layers = toy_layers(depth=depth, dropout=dropout, batch_norm=batch_norm)

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.layers(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def toy_loader(*, n: int = 64, batch_size: int = 16, seed: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def fit(
    module: L.LightningModule,
    strategy: Any,
    *,
    steps: int = 4,
    seed: int = 123,
    ckpt_path: Any = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """Trains `steps` optimizer steps on CPU with a fixed seed (in all, from ``ckpt_path`` if given)."""
    kwargs: Dict[str, Any] = dict(QUIET, devices=1, max_steps=steps)
    kwargs.update(trainer_kwargs)
    torch.manual_seed(seed)
    trainer = L.Trainer(strategy=strategy, **kwargs)
    trainer.fit(module, toy_loader(), ckpt_path=ckpt_path)
    return trainer


def params(module: nn.Module) -> Dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_bitwise_equal(a: Dict[str, Tensor], b: Dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs by {(a[k] - b[k]).abs().max().item()}"


def max_relative_difference(a: Dict[str, Tensor], b: Dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in a)
