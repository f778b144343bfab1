"""PEFT LoRA on a tiny Llama fine-tuned from a pretrained directory (tests/support/pretrained_models.py's,
bf16 in shards): built on the meta device in ``configure_model``, marked :func:`pipeckpt.pretrained`
on the base model before ``get_peft_model`` wraps it (``mark='base'``) or on the ``PeftModel`` after
(``mark='peft'``). Shared by the single-process tests and the distributed worker."""

from pathlib import Path
from typing import Any, Dict

import lightning as L
import torch
import transformers
from torch import Tensor, nn

import pipeckpt

LAYERS = "base_model.model.model.layers"


def lora_config(**overrides: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        **dict(dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]), **overrides)
    )


class LoraFromPretrained(L.LightningModule):
    def __init__(self, path: Path, mark: str = "base", **lora: Any) -> None:
        super().__init__()
        self.path, self.mark, self.lora, self.model = Path(path), mark, lora, None

    def configure_model(self) -> None:
        from peft import get_peft_model

        if self.model is not None:
            return
        config = transformers.AutoConfig.from_pretrained(self.path)
        base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if self.mark == "base":
            base = pipeckpt.pretrained(base, self.path)
        model = get_peft_model(base, lora_config(**self.lora))
        self.model = pipeckpt.pretrained(model, self.path) if self.mark == "peft" else model

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, LAYERS)

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def base_key(key: str) -> str:
    """A key of the PEFT model as the pretrained directory names it (None-free: adapters unchanged)."""
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def is_adapter(key: str) -> bool:
    return ".lora_" in key
