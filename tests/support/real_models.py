"""The two real clients of examples/ (Hugging Face GPT-2, Lightning's demo Transformer) as a test
and its worker processes build them: the same module, initial weights and data in every process."""

import importlib.util
import sys
from pathlib import Path
from typing import Any, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> Any:
    """The example script ``examples/<name>.py`` as a module (its ``__main__`` part does not run)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _sgd(module: L.LightningModule) -> torch.optim.Optimizer:
    # Adam divides by the root of a gradient's square: where a gradient is rounding noise (GPT-2's
    # key bias, which softmax ignores), it turns 1e-9 differences into steps of lr. SGD keeps the
    # comparison of trained weights a comparison of gradients.
    return torch.optim.SGD(module.parameters(), lr=0.1)


def _gpt2_module(ex: Any) -> Any:
    class GPT2SlotMean(ex.GPT2Module):
        """The example's module, its loss a sum over the tokens divided by the batch's token slots:
        the distributed engine's loss is the mean of the micro-batches' losses, which equals the
        whole batch's only for a loss that is a mean over samples; the example's mean over the
        unpadded tokens of each micro-batch is not (micro-batches hold different numbers)."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids, mask = batch
            logits = self.model(ids, attention_mask=mask).logits
            labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            flat = logits[:, :-1].flatten(0, 1)
            summed = F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="sum")
            return summed / labels.numel()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _sgd(self)

    return GPT2SlotMean


def client(name: str, *, dropout: float = 0.0) -> Tuple[L.LightningModule, DataLoader]:
    """The example's LightningModule (weights drawn from seed 0, trained by SGD) and its data."""
    torch.manual_seed(0)
    if name == "gpt2":
        ex = example("gpt2_pipeline")
        return _gpt2_module(ex)(ex.config(dropout)), ex.data()
    ex = example("demo_transformer_pipeline")
    return ex.DemoModule(dropout=dropout), ex.data()  # SGD already
