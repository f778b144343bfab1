"""Five Hugging Face models as their users build them (tiny configs, random weights from seed 0,
nothing downloaded, ``use_cache`` left at the configs' default), each in a LightningModule whose
``configure_pipeline`` names its blocks with ``pipeline_of`` and whose loss is a mean over the
batch's tokens (so it is the same, pipelined or not, and under both engines)."""

from typing import Any, Callable, Dict, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import pipeckpt

VOCAB = 64
NAMES = ("gpt2", "llama", "qwen2", "bert", "t5")


def _gpt2(dropout: float) -> Tuple[nn.Module, Tuple[str, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=4, n_head=2,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return GPT2LMHeadModel(config), ("transformer.h",)


def _llama(dropout: float) -> Tuple[nn.Module, Tuple[str, ...]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, attention_dropout=dropout,
    )  # fmt: skip
    return LlamaForCausalLM(config), ("model.layers",)


def _qwen2(dropout: float) -> Tuple[nn.Module, Tuple[str, ...]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, attention_dropout=dropout,
    )  # fmt: skip
    return Qwen2ForCausalLM(config), ("model.layers",)


def _bert(dropout: float) -> Tuple[nn.Module, Tuple[str, ...]]:
    from transformers import BertConfig, BertLMHeadModel

    # BERT as a causal LM (a decoder): the configuration that keeps a KV cache.
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=16, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        is_decoder=True,
    )  # fmt: skip
    return BertLMHeadModel(config), ("bert.encoder.layer",)


def _t5(dropout: float) -> Tuple[nn.Module, Tuple[str, ...]]:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=dropout, decoder_start_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(config), ("encoder.block", "decoder.block")


BUILDERS: Dict[str, Callable[[float], Tuple[nn.Module, Tuple[str, ...]]]] = {
    "gpt2": _gpt2, "llama": _llama, "qwen2": _qwen2, "bert": _bert, "t5": _t5,
}  # fmt: skip


class HFModule(L.LightningModule):
    """One of :data:`NAMES`, trained by SGD on the mean cross-entropy over the batch's tokens."""

    def __init__(self, name: str, dropout: float) -> None:
        super().__init__()
        self.name_ = name
        self.model, self.layers = BUILDERS[name](dropout)

    def configure_pipeline(self) -> Any:
        return pipeckpt.pipeline_of(self.model, *self.layers)

    def logits(self, ids: Tensor) -> Tensor:
        if self.name_ == "t5":
            return self.model(ids, decoder_input_ids=ids.flip(1)).logits
        return self.model(ids).logits

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        return F.cross_entropy(self.logits(ids).flatten(0, 1), ids.roll(1, 1).flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def hf_module(name: str, *, dropout: float = 0.1) -> HFModule:
    """The model ``name`` with its initial weights drawn from seed 0."""
    torch.manual_seed(0)
    return HFModule(name, dropout)


def hf_data(samples: int = 16, length: int = 8, batch_size: int = 8) -> DataLoader:
    """Token ids, the same in every process."""
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randint(0, VOCAB, (samples, length), generator=g)), batch_size=batch_size
    )
