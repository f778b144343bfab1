"""Models with frozen parameters, as people fine-tune: the toy Sequential with two blocks set to
``requires_grad_(False)``, and PEFT LoRA on a tiny random Llama (its base frozen, nothing
downloaded), the pipeline's layer list under ``get_peft_model``'s wrappers. Shared by the frozen
parameter tests and their worker processes."""

from typing import Any, Dict

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from pipeckpt import pipeline_of
from support.hf_models import batches
from support.toy import ToyModule

#: The toy's frozen blocks (Tanh, Dropout, Linear 16 x 16 each): one in either stage of [3, 3].
FROZEN = ("layers.2.", "layers.4.")
#: Where PEFT puts the Llama's blocks: PeftModel.base_model (LoraModel).model (LlamaForCausalLM).model.layers
LORA_LAYERS = "base_model.model.model.layers"


def frozen_toy() -> ToyModule:
    module = ToyModule()
    module.layers[2].requires_grad_(False)
    module.layers[4].requires_grad_(False)
    return module


class LoraLlama(L.LightningModule):
    """A tiny random Llama under PEFT LoRA (rank 4 on the attention's q and v projections, dropout 0),
    trained with HF's own loss; its optimizer takes the trained parameters only, as PEFT's users do."""

    def __init__(self) -> None:
        super().__init__()
        import transformers
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
            attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(transformers.LlamaForCausalLM(config), lora)

    def configure_pipeline(self) -> nn.Module:
        return pipeline_of(self.model, LORA_LAYERS)

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def lora_loader() -> DataLoader:
    return DataLoader(batches(2), batch_size=None)


def trained_names(module: nn.Module) -> set:
    return {k for k, p in module.named_parameters() if p.requires_grad}
