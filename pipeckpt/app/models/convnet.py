"""A small convolutional classifier with BatchNorm, as a flat ``nn.Sequential``.

It exists to exercise deferred BatchNorm. A pipeline feeds a mini-batch to each
stage as ``chunks`` micro-batches, so a plain ``BatchNorm2d`` would update its
running statistics once per micro-batch, from a fraction of the batch.
``deferred_batch_norm=True`` makes the strategy accumulate the statistics over
the micro-batches and update them once per mini-batch, as without a pipeline.
"""

from torch import nn

from pipeckpt.app.models._classifier import Classifier

__all__ = ["ConvNet", "convnet_layers"]


def _conv_bn_relu(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [
        # No bias: the BatchNorm right after it has its own shift.
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    ]


def convnet_layers(*, in_channels: int, width: int, num_classes: int) -> nn.Sequential:
    """Three ``Conv-BN-ReLU`` groups (the middle one followed by 2x2 pooling),
    global average pooling and a linear classifier: 13 children; any image size."""
    return nn.Sequential(
        *_conv_bn_relu(in_channels, width),
        *_conv_bn_relu(width, 2 * width),
        nn.MaxPool2d(2),
        *_conv_bn_relu(2 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )


class ConvNet(Classifier):
    """Classifies ``(B, in_channels, H, W)`` images into ``num_classes`` classes."""

    def __init__(
        self,
        *,
        in_channels: int = 3,
        width: int = 16,
        num_classes: int = 10,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        self.layers = convnet_layers(in_channels=in_channels, width=width, num_classes=num_classes)
