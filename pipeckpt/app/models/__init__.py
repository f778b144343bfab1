"""Example models for pipeckpt, each a LightningModule with ``configure_pipeline``."""

from pipeckpt.app.models.convnet import ConvNet
from pipeckpt.app.models.gpt import GPT, SIZES, gpt_layers
from pipeckpt.app.models.mlp import MLP

__all__ = ["GPT", "SIZES", "gpt_layers", "MLP", "ConvNet"]
