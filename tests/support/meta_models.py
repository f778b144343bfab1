"""The toy module built in ``configure_model`` (on the meta device under the ``pipe`` strategy), and
one whose extra layer cannot initialise itself: shared by the meta-build tests and their worker."""

from typing import Any

import torch
from torch import nn

from support.toy import ToyModule, toy_layers


class Configured(ToyModule):
    """:class:`ToyModule` (BatchNorm on) whose layers ``configure_model`` builds, seeded as
    ``ToyModule.__init__`` seeds its eager build."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(batch_norm=True, **kwargs)
        self.layers = None  # type: ignore[assignment]
        self.built_on = ""  # the device configure_model built on
        self.held_when_built = -1  # elements of its tensors that configure_model made real

    def configure_model(self) -> None:
        if self.layers is None:
            self.built_on = torch.empty(()).device.type
            torch.manual_seed(self.hparams.seed)
            self.layers = toy_layers(batch_norm=True)
            self.held_when_built = held(self.layers)


class Gain(nn.Module):
    """A layer that owns a parameter and has no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Uninitialisable(Configured):
    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.Sequential(*toy_layers(batch_norm=True), Gain())


def held(module: nn.Module) -> int:
    """Elements of ``module``'s tensors that are not on the meta device."""
    return sum(t.numel() for t in (*module.parameters(), *module.buffers()) if not t.is_meta)


def eager_layers(seed: int) -> nn.Sequential:
    """What an eager build of :class:`Configured`'s layers gives with ``seed``."""
    torch.manual_seed(seed)
    return toy_layers(batch_norm=True)
