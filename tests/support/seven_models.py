"""The seven models of the acceptance matrix, as their users write them: five Hugging Face models
(tiny random configs of tests/support/hf_zoo.py, nothing downloaded) whose ``training_step`` is
HF's own ``self.model(**batch).loss``, Lightning's demo Transformer (examples/, unmodified) and the
bundled BatchNorm CNN. Built the same in every process: weights from seed 0, fixed batches."""

from typing import Any, Dict, List, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import pipeckpt
from pipeckpt.app.models.convnet import convnet_layers
from support.hf_zoo import BUILDERS, VOCAB
from support.real_models import client

HF = ("gpt2", "llama", "qwen2", "bert", "t5")
NAMES = (*HF, "demo", "convnet")
LENGTH, BATCH, BATCHES = 8, 8, 2


class HFLoss(L.LightningModule):
    """An HF model trained by SGD on the loss the model computes itself from ``labels``."""

    def __init__(self, name: str, dropout: float) -> None:
        super().__init__()
        self.model, self.layers = BUILDERS[name](dropout)

    def configure_pipeline(self) -> Any:
        return pipeckpt.pipeline_of(self.model, *self.layers)

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ConvNetModule(L.LightningModule):
    """The bundled CNN (Conv-BatchNorm-ReLU groups) as a plain Sequential, cross-entropy, SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = convnet_layers(in_channels=1, width=4, num_classes=3)

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _token_batches() -> List[Dict[str, Tensor]]:
    """input_ids, attention_mask and labels with right padding of different lengths (the padding's
    labels -100), so micro-batches hold different numbers of label tokens."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(BATCHES):
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g)
        lengths = torch.randint(3, LENGTH + 1, (BATCH,), generator=g)
        mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def model_and_data(name: str, *, dropout: float = 0.0) -> Tuple[L.LightningModule, DataLoader]:
    """The LightningModule ``name`` (weights from seed 0) and its training data."""
    torch.manual_seed(0)
    if name in HF:
        return HFLoss(name, dropout), DataLoader(_token_batches(), batch_size=None)
    if name == "demo":
        module, loader = client("demo", dropout=dropout)
        return module, DataLoader(list(loader)[:BATCHES], batch_size=None)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH * BATCHES, 1, 6, 6, generator=g)
    labels = torch.randint(0, 3, (BATCH * BATCHES,), generator=g)
    return ConvNetModule(), DataLoader(TensorDataset(images, labels), batch_size=BATCH)


def weights(module: L.LightningModule) -> Dict[str, Tensor]:
    """The trained parameters (BatchNorm's running statistics are compared on their own)."""
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def relative_difference(a: Dict[str, Tensor], b: Dict[str, Tensor]) -> float:
    """The largest difference of any weight, relative to the model's largest weight. Per tensor would
    be noise: a bias that softmax ignores (BERT's attention key bias) has a gradient of rounding
    error alone, 1e-14, that differs in its first digit with the order of additions."""
    assert a.keys() == b.keys()
    largest = max(float(t.abs().max()) for t in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / largest


def unpipelined_trainer_options(name: str, chunks: int) -> Dict[str, Any]:
    """The unpipelined run a pipelined one of ``chunks`` micro-batches equals: the same, except the
    BatchNorm CNN, which normalises each micro-batch by its own statistics in a pipeline (GPipe's
    rule) and so equals gradient accumulation over micro-batch-sized batches."""
    return dict(accumulate_grad_batches=chunks) if name == "convnet" else {}


def unpipelined_data(name: str, loader: DataLoader, chunks: int) -> DataLoader:
    """``loader`` (the data of :func:`model_and_data`) as the unpipelined reference run reads it."""
    if name != "convnet":
        return loader
    return DataLoader(loader.dataset, batch_size=BATCH // chunks)
