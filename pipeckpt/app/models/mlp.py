"""A multilayer perceptron classifier: the smallest model worth pipelining.

Its Sequential is flat (``Linear, ReLU, Linear, ReLU, ..., Linear``) so that
every layer is a possible cut; useful for tests, where a pipeline must be
cheap, and for seeing how balance moves layers between stages.
"""

from torch import nn

from pipeckpt.app.models._classifier import Classifier

__all__ = ["MLP", "mlp_layers"]


def mlp_layers(*, in_features: int, hidden: int, depth: int, num_classes: int) -> nn.Sequential:
    """``depth`` hidden ``Linear + ReLU`` pairs, then a linear classifier: ``2 * depth + 1`` children."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1 (depth: {depth}); set depth >= 1")
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class MLP(Classifier):
    """Classifies ``(B, in_features)`` vectors into ``num_classes`` classes."""

    def __init__(
        self,
        *,
        in_features: int = 32,
        hidden: int = 128,
        depth: int = 4,
        num_classes: int = 10,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        self.layers = mlp_layers(in_features=in_features, hidden=hidden, depth=depth, num_classes=num_classes)
