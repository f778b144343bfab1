"""Hugging Face causal LMs as their users write them: tiny random GPT-2 and Llama (nothing
downloaded, dropout 0), a LightningModule whose ``training_step`` is one HF call, and batches as
dicts of input_ids, attention_mask and labels. Shared by the tests of HF's own calls and their
worker processes."""

from typing import Callable, Dict, List

import lightning as L
import torch
import transformers
from torch import Tensor, nn

from pipeckpt import pipeline_of

VOCAB, LENGTH, BATCH = 64, 12, 8


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=2, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


MODELS: Dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama}
LAYERS = {"gpt2": "transformer.h", "llama": "model.layers"}


def batches(n: int = 2) -> List[Dict[str, Tensor]]:
    """Dicts of input_ids, attention_mask and labels: right padding of different lengths, the
    padding's labels -100, so the micro-batches of a batch hold different numbers of label tokens."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g)
        lengths = torch.randint(2, LENGTH + 1, (BATCH,), generator=g)
        lengths[:2] = 2  # the first micro-batch has few label tokens
        mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


class HFModule(L.LightningModule):
    """A LightningModule as an HF user writes it; ``step`` is its whole training step."""

    def __init__(self, name: str, step: Callable[[nn.Module, Dict[str, Tensor]], Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MODELS[name]()
        self.layers = LAYERS[name]
        self.step = step

    def configure_pipeline(self) -> nn.Module:
        return pipeline_of(self.model, self.layers)

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.step(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def whole(model: nn.Module, batch: Dict[str, Tensor]) -> Tensor:
    return model(**batch).loss


def keywords(model: nn.Module, batch: Dict[str, Tensor]) -> Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


STEPS: Dict[str, Callable[[nn.Module, Dict[str, Tensor]], Tensor]] = {"whole": whole, "keywords": keywords}
