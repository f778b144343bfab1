"""Llama 3 as a flat ``nn.Sequential`` of Hugging Face's own decoder layers, sized 8B to 405B.

The elements are the token embedding, one ``transformers`` ``LlamaDecoderLayer`` per block (with
the rotary table as a buffer shared by all blocks, as torchtitan keeps ``freqs_cis``), and the final
norm with the head, so the planner cuts between any two. Why not ``LlamaForCausalLM`` with
``pipeline_of``: the memory model profiles a chain of layers, which a model's own ``forward`` is not.
``tensor_parallel=t`` builds what one rank of a Megatron-style tensor-parallel layout computes:
heads, KV heads, the MLP's width and the vocabulary divided by ``t``, the hidden size kept
(docs/MEMORY.md, "Per rank under FSDP2, TP and PP").
"""

from typing import Any, Dict, Tuple

import lightning as L
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from pipeckpt._errors import config_error

__all__ = ["LLAMA_SIZES", "llama_config", "llama_layers", "Llama"]

#: Llama 3 (layers, hidden, heads, KV heads, MLP width, vocabulary), from Meta's model cards; ``tiny``
#: trains on a CPU.
LLAMA_SIZES: Dict[str, Tuple[int, int, int, int, int, int]] = {
    "tiny": (2, 64, 4, 2, 128, 512),
    "8B": (32, 4096, 32, 8, 14336, 128256),
    "70B": (80, 8192, 64, 8, 28672, 128256),
    "405B": (126, 16384, 128, 8, 53248, 128256),
}


#: Torch's fused attention (no ``s x s`` scores kept), as torchtitan runs; HF's config takes it as a
#: keyword its signature does not list.
SDPA: Dict[str, Any] = {"attn_implementation": "sdpa"}


def llama_config(size: str, *, seq_len: int, tensor_parallel: int = 1) -> transformers.LlamaConfig:
    """The ``LlamaConfig`` of one rank's share of ``size`` under ``tensor_parallel`` ranks.

    Args:
        size: a key of :data:`LLAMA_SIZES`.
        seq_len: the longest sequence (the rotary table's length).
        tensor_parallel: tensor-parallel ranks; heads, KV heads, MLP width and vocabulary divide by it.
    """
    if size not in LLAMA_SIZES:
        raise config_error(f"model.size={size!r}", f"the Llama sizes are {list(LLAMA_SIZES)}", "pick one")
    layers, hidden, heads, kv, width, vocab = LLAMA_SIZES[size]
    split = {"heads": heads, "kv_heads": kv, "intermediate": width, "vocab": vocab}
    for name, value in split.items():
        if tensor_parallel < 1 or value % tensor_parallel:
            raise config_error(
                f"tensor_parallel={tensor_parallel} for Llama {size}",
                f"each rank takes an equal share of the {name} ({value})",
                f"use a tensor-parallel degree that divides {value}",
            )
    return transformers.LlamaConfig(
        vocab_size=vocab // tensor_parallel,
        hidden_size=hidden,
        intermediate_size=width // tensor_parallel,
        num_hidden_layers=layers,
        num_attention_heads=heads // tensor_parallel,
        num_key_value_heads=kv // tensor_parallel,
        head_dim=hidden // heads,
        max_position_embeddings=seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        attention_dropout=0.0,
        use_cache=False,
        **SDPA,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


class Embed(nn.Module):
    """Token ids ``(B, T)`` to ``(B, T, hidden)``."""

    def __init__(self, config: transformers.LlamaConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token(tokens)


class Block(nn.Module):
    """One ``LlamaDecoderLayer``, causal, with the shared rotary table (a buffer: no activation)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: transformers.LlamaConfig, index: int, rope: Tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.layer = LlamaDecoderLayer(config, index)
        self.register_buffer("cos", rope[0], persistent=False)
        self.register_buffer("sin", rope[1], persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.size(1)
        rope = (self.cos[:, :t].to(h.dtype), self.sin[:, :t].to(h.dtype))
        out: torch.Tensor = self.layer(h, position_embeddings=rope)
        return out


class Head(nn.Module):
    """The final RMSNorm and the output projection: ``(B, T, hidden)`` to logits."""

    def __init__(self, config: transformers.LlamaConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.output(self.norm(h))
        return out


def llama_layers(config: transformers.LlamaConfig) -> nn.Sequential:
    """Embedding, ``config.num_hidden_layers`` blocks, head: ``num_hidden_layers + 2`` elements.

    Args:
        config: e.g. :func:`llama_config`'s.
    """
    with torch.no_grad():
        positions = torch.arange(config.max_position_embeddings)[None]
        probe = torch.empty(0, dtype=torch.get_default_dtype())
        cos, sin = LlamaRotaryEmbedding(config)(probe, positions)
    blocks = [Block(config, i, (cos, sin)) for i in range(config.num_hidden_layers)]
    return nn.Sequential(Embed(config), *blocks, Head(config))


class Llama(L.LightningModule):
    """A Llama 3 language model whose layers form the pipeline.

    Args:
        size: a key of :data:`LLAMA_SIZES`.
        seq_len: the longest training sequence.
        tensor_parallel: build one tensor-parallel rank's share (for planning, :func:`llama_config`).
        vocab_size: the range of the token ids the data holds (the synthetic data reads it); the
            model's vocabulary is the size's, which must hold it.
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
    """

    def __init__(
        self,
        *,
        size: str = "tiny",
        seq_len: int = 128,
        tensor_parallel: int = 1,
        vocab_size: int = 256,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.weight_decay = lr, weight_decay
        self.config = llama_config(size, seq_len=seq_len, tensor_parallel=tensor_parallel)
        if vocab_size > self.config.vocab_size:
            raise config_error(
                f"model.vocab_size={vocab_size}",
                f"the token ids must fit Llama {size}'s vocabulary per rank ({self.config.vocab_size})",
                f"set model.vocab_size <= {self.config.vocab_size}",
            )
        self.layers = llama_layers(self.config)

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(tokens)
        return out

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss on the pipeline's output (``checkpoint='auto'`` profiles its memory too)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def _loss(self, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return self.pipeline_loss(self.layers(tokens), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
