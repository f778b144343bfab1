"""The bundled models at the sizes the memory model is checked at (tests/memory/test_memory.py and
benchmarks/bench_memory_model.py): each built with seed 0, with one batch divisible by 1 to 4 chunks."""

import functools
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from harness.stage_memory import split_batch
from pipeckpt.app.models.convnet import convnet_layers
from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.app.models.mlp import mlp_layers
from pipeckpt.memory.profile import profile


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


# The configs' models (conf/model/*.yaml) at test sizes; batches divisible by 1 to 4 chunks.
MODELS: Dict[str, Tuple[Callable[[], nn.Sequential], Callable[[torch.Generator], Tuple[Any, Any]], Any]] = {
    "gpt": (
        lambda: gpt_layers(vocab_size=256, d_model=64, n_heads=4, n_layers=4, seq_len=32, dropout=0.1),
        lambda g: (torch.randint(256, (12, 32), generator=g), torch.randint(256, (12, 32), generator=g)),
        lm_loss,
    ),
    "mlp": (
        lambda: mlp_layers(in_features=32, hidden=128, depth=4, num_classes=10),
        lambda g: (torch.randn(48, 32, generator=g), torch.randint(10, (48,), generator=g)),
        F.cross_entropy,
    ),
    "convnet": (
        lambda: convnet_layers(in_channels=3, width=8, num_classes=10),
        lambda g: (torch.randn(24, 3, 16, 16, generator=g), torch.randint(10, (24,), generator=g)),
        F.cross_entropy,
    ),
}


@functools.cache
def model_of(name: str) -> Tuple[nn.Sequential, Any, Any, Any]:
    build, data, loss = MODELS[name]
    torch.manual_seed(0)
    return build(), *data(torch.Generator().manual_seed(0)), loss


@functools.cache
def profile_of(name: str, chunks: int) -> Any:
    seq, x, y, loss = model_of(name)
    return profile(seq, split_batch(x, chunks), loss_fn=loss, target=split_batch(y, chunks), rounds=1)
