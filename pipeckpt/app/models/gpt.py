"""A GPT-2 style language model written as a flat ``nn.Sequential``.

Every element takes one tensor and returns one (the embedding folds token and position, each block
keeps its residual stream inside itself, the final LayerNorm and the head are elements of their own),
so the planner can cut and balance between any two. Why not Hugging Face's GPT-2: the app needs no
extra package, and shows the plain Sequential path (``pipeline_of`` is docs/REAL_MODELS.md's). The
LightningModule is single-device Lightning code plus ``configure_pipeline``.
"""

import math
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from pipeckpt.app.throughput import model_flops_per_token

__all__ = ["SIZES", "gpt_layers", "GPT"]

#: Architecture presets. ``small`` is GPT-2 small (124M parameters with the
#: GPT-2 vocabulary; about 85M with the 256-symbol byte vocabulary used here).
#: ``seq_len``, ``vocab_size`` and ``dropout`` are not part of a size: they
#: depend on the data and the run, not on the architecture.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 128, "n_heads": 4, "n_layers": 4},
    "mini": {"d_model": 256, "n_heads": 8, "n_layers": 8},
    "small": {"d_model": 768, "n_heads": 12, "n_layers": 12},
}


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` integers to ``(B, T, d_model)``.

    Both tables live in one module so that the first pipeline stage receives
    token ids and nothing else.
    """

    def __init__(self, *, vocab_size: int, d_model: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.size(1)
        if length > self.seq_len:
            raise ValueError(
                f"sequence longer than the position table (tokens: {length}, seq_len: {self.seq_len}); "
                f"build the model with seq_len >= {length} or feed shorter windows"
            )
        positions = torch.arange(length, device=tokens.device)
        return self.dropout(self.token(tokens) + self.position(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head attention in which position ``t`` sees positions ``<= t`` only."""

    def __init__(self, *, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(
                f"d_model must be a multiple of n_heads (d_model: {d_model}, n_heads: {n_heads}); "
                f"pick n_heads dividing {d_model}"
            )
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads), the layout SDPA expects.
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, length, width)
        return self.proj_dropout(self.proj(y))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, *, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model=d_model, n_heads=n_heads, dropout=dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


def _init_gpt2(layers: nn.Sequential, *, n_layers: int) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, and the two
    projections that write into the residual stream scaled by 1/sqrt(2 n_layers)
    so that the stream's variance does not grow with depth."""
    for module in layers.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    for module in layers:
        if isinstance(module, Block):
            nn.init.normal_(module.attn.proj.weight, mean=0.0, std=residual_std)
            mlp_out = module.mlp[2]
            assert isinstance(mlp_out, nn.Linear), "Block.mlp is Linear, GELU, Linear, Dropout"
            nn.init.normal_(mlp_out.weight, mean=0.0, std=residual_std)


def gpt_layers(
    *, vocab_size: int, d_model: int, n_heads: int, n_layers: int, seq_len: int, dropout: float
) -> nn.Sequential:
    """The whole GPT as ``[Embedding, Block x n_layers, LayerNorm, Linear head]``.

    ``n_layers + 3`` children, each mapping one tensor to one tensor:
    ``(B, T)`` token ids in, ``(B, T, vocab_size)`` logits out. The head is not
    tied to the token embedding, because a parameter shared by two children
    could not be split across pipeline stages.
    """
    layers = nn.Sequential(
        Embedding(vocab_size=vocab_size, d_model=d_model, seq_len=seq_len, dropout=dropout),
        *(Block(d_model=d_model, n_heads=n_heads, dropout=dropout) for _ in range(n_layers)),
        nn.LayerNorm(d_model),
        nn.Linear(d_model, vocab_size, bias=False),
    )
    _init_gpt2(layers, n_layers=n_layers)
    return layers


def warmup_cosine(*, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """Learning-rate multiplier: linear warm-up, then cosine decay to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class GPT(L.LightningModule):
    """Next-token prediction with a GPT built by :func:`gpt_layers`.

    ``size`` picks a preset from :data:`SIZES`; ``**overrides`` replaces any of
    its fields (``GPT(size="tiny", n_layers=8)``); an override of None keeps
    the preset's value, so a config can list every field.
    """

    def __init__(
        self,
        *,
        size: str = "tiny",
        vocab_size: int = 256,
        seq_len: int = 128,
        dropout: float = 0.1,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        **overrides: Optional[int],
    ) -> None:
        super().__init__()
        if size not in SIZES:
            raise ValueError(f"unknown GPT size {size!r}; choose one of {sorted(SIZES)}")
        unknown = set(overrides) - set(SIZES[size])
        if unknown:
            raise TypeError(
                f"unknown GPT arguments {sorted(unknown)}; a size can override only {sorted(SIZES[size])}"
            )
        self.save_hyperparameters()
        # Typed copies for configure_optimizers: hparams is an untyped mapping.
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        arch = {**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}
        # The sizes built, not None for "the size's": a resume of another model names the real values.
        self.hparams.update(arch)
        self.layers = gpt_layers(vocab_size=vocab_size, seq_len=seq_len, dropout=dropout, **arch)
        self.flops_per_token = model_flops_per_token(self.layers)  # for the MFU (app/throughput.py)

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(tokens)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss on the pipeline's output (``checkpoint='auto'`` profiles its memory too)."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return self.pipeline_loss(self.layers(tokens), targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        # Decay matrices and embedding tables only: pulling biases and
        # LayerNorm gains towards zero regularises nothing useful.
        decay = [p for p in self.layers.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.layers.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.lr,
            betas=(0.9, 0.95),
        )
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else math.inf
        # An unbounded run (max_steps=-1, max_epochs=-1) warms up and then keeps the peak rate.
        total = int(total) if math.isfinite(total) else 2**62
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine(warmup_steps=self.warmup_steps, total_steps=total)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
