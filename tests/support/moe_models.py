"""Mixture-of-experts causal LMs as their users train them: tiny random Mixtral and Qwen3-MoE (nothing
downloaded) with the routers' load-balancing loss on (``output_router_logits=True``,
``router_aux_loss_coef=0.1``), in a LightningModule whose ``training_step`` is
``self.model(**batch).loss``; and the unpipelined reference that computes the same per-micro-batch
losses and combines them as the pipeline does (docs/REAL_MODELS.md, "Mixture of experts")."""

from typing import Any, Callable, Dict, List

import lightning as L
import torch
import transformers
from torch import Tensor, nn

from pipeckpt import pipeline_of
from support.hf_models import VOCAB

COEF = 0.1
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
    max_position_embeddings=32, use_cache=False, output_router_logits=True, router_aux_loss_coef=COEF,
    attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip


def mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        **COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    )
    return transformers.MixtralForCausalLM(config)


def qwen3_moe() -> nn.Module:
    config = transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


MOE: Dict[str, Callable[[], nn.Module]] = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}


def is_router(name: str) -> bool:
    """Whether the parameter ``name`` is a router's (Mixtral's and Qwen3-MoE's ``mlp.gate``)."""
    return ".mlp.gate." in name


def pieces(batch: Dict[str, Tensor], chunks: int) -> List[Dict[str, Tensor]]:
    """The batch cut into ``chunks`` micro-batches along dimension 0, as the pipeline cuts it."""
    cut = {k: v.chunk(chunks) for k, v in batch.items()}
    return [{k: v[i] for k, v in cut.items()} for i in range(chunks)]


def per_microbatch_loss(model: nn.Module, batch: Dict[str, Tensor], chunks: int) -> Tensor:
    """The rule: each micro-batch's loss (its cross-entropy plus the coefficient times its own
    load-balancing loss), weighted by its share of the batch's label tokens."""
    parts = pieces(batch, chunks)
    counts = [int((p["labels"][:, 1:] != -100).sum()) for p in parts]
    return sum(model(**p).loss * (n / sum(counts)) for p, n in zip(parts, counts))


class MoEModule(L.LightningModule):
    """A MoE model trained by SGD on HF's own loss; ``chunks`` set: the unpipelined reference that
    combines per-micro-batch losses itself. Keeps the losses its step returns (per micro-batch under the
    distributed engine), each step's reported loss, and the first step's router gradients."""

    def __init__(self, name: str, *, chunks: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MOE[name]()
        self.chunks = chunks
        self.losses: List[float] = []
        self.step_losses: List[float] = []
        self.router_grads: Dict[str, Tensor] = {}

    def configure_pipeline(self) -> nn.Module:
        return pipeline_of(self.model, "model.layers")

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = (
            per_microbatch_loss(self.model, batch, self.chunks) if self.chunks else self.model(**batch).loss
        )
        self.losses.append(float(loss))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.router_grads:
            named = self.model.named_parameters()
            self.router_grads = {k: p.grad.clone() for k, p in named if is_router(k) and p.grad is not None}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
