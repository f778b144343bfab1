"""Example models for pipeckpt, each a LightningModule with ``configure_pipeline``."""

from pipeckpt.models.convnet import ConvNet
from pipeckpt.models.gpt import GPT, SIZES, gpt_layers
from pipeckpt.models.mlp import MLP

__all__ = ["GPT", "SIZES", "gpt_layers", "MLP", "ConvNet"]
