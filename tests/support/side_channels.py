"""Models whose layers hand a tensor out other than through their return value: a Sequential whose
third layer appends its activation to a list the step's auxiliary loss reads, and the same through a
forward hook on a ``pipeline_of`` model's layer; and one whose hook keeps the very tensor a stage
returns (a hook on a block's last module), or, allowed, a hook on the pipelined block itself. Shared by
the local tests and the distributed worker (tests/stages/test_escapes.py,
tests/engines/distributed/test_escapes_distributed.py)."""

from typing import Any, List

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import pipeckpt

WIDTH = 8


class Stashing(nn.Module):
    """A linear layer that appends its activation to ``stash`` (``detached``: a copy without graph)."""

    def __init__(self, stash: List[Tensor], *, detached: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.stash, self.detached = stash, detached

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.linear(x))
        self.stash.append(y.detach() if self.detached else y)
        return y


class SideChannel(L.LightningModule):
    """Four layers, the ``at``-th stashing its activation; the loss adds the stashed ones' mean square."""

    def __init__(self, *, at: int = 1, detached: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stash: List[Tensor] = []
        layers: List[nn.Module] = [nn.Linear(WIDTH, WIDTH) for _ in range(4)]
        layers[at] = Stashing(self.stash, detached=detached)
        self.layers = nn.Sequential(*layers)

    def configure_pipeline(self) -> nn.Module:
        return self.layers

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        out = self.layers(x)
        aux = sum(a.pow(2).mean() for a in self.stash) if self.stash else out.new_zeros(())
        self.stash.clear()
        return out.pow(2).mean() + 0.1 * aux

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Blocks(nn.Module):
    """A model with its own ``forward`` over a list of blocks, for ``pipeline_of``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class HookedBlocks(L.LightningModule):
    """:class:`Blocks` pipelined, a forward hook on block 1's linear storing its output for the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Blocks()
        self.stash: List[Tensor] = []
        self.model.blocks[1][0].register_forward_hook(lambda m, args, out: self.stash.append(out))

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, "blocks")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        out = self.model(x)
        aux = sum(a.pow(2).mean() for a in self.stash)
        self.stash.clear()
        return out.pow(2).mean() + 0.1 * aux

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ReStoring(L.LightningModule):
    """:class:`Blocks` pipelined, a forward hook appending the output of block ``at`` to a list the
    loss reads: on the block's last module (``inside``: the same tensor the block returns, and its
    stage when the block ends one) or on the block itself (run on what the stage returned). The aux
    term is a sum over the batch's rows, so it adds up over micro-batches as over the whole batch."""

    def __init__(self, *, at: int = 1, inside: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Blocks()
        self.stash: List[Tensor] = []
        hooked = self.model.blocks[at][1] if inside else self.model.blocks[at]
        hooked.register_forward_hook(lambda m, args, out: self.stash.append(out))

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, "blocks")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        out = self.model(x)
        aux = sum(a.pow(2).sum() for a in self.stash) / x.shape[0]
        self.stash.clear()
        return out.pow(2).mean() + 0.1 * aux

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(16, WIDTH, generator=g)), batch_size=8)
