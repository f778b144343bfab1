"""Hugging Face models whose parts outside the layers matter (tests/engines/distributed/
test_outside_parts_distributed.py): Llama with a vocabulary that outweighs its layers, Gemma3
(head tied to a scaled embedding), BART (one embedding under four names, encoder and decoder),
Qwen3-MoE; random weights from configs, built the same in every process, trained by SGD."""

from typing import Any, Callable, Dict, List, Tuple

import lightning as L
import torch
import transformers as hf
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import pipeckpt

COMMON = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)


def llama() -> nn.Module:
    # The acceptance's shape: vocabulary 32000, hidden 128, 4 layers (the embedding and head are
    # 94% of the parameters).
    config = hf.LlamaConfig(
        vocab_size=32000, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, **COMMON,
    )  # fmt: skip
    return hf.LlamaForCausalLM(config)


def gemma3() -> nn.Module:
    config = hf.Gemma3TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=4, **COMMON,
    )  # fmt: skip
    return hf.Gemma3ForCausalLM(config)


def bart() -> nn.Module:
    config = hf.BartConfig(
        vocab_size=256, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=0,
        forced_eos_token_id=None,
        **COMMON,
    )  # fmt: skip
    return hf.BartForConditionalGeneration(config)


def qwen3_moe() -> nn.Module:
    config = hf.Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, **COMMON,
    )  # fmt: skip
    return hf.Qwen3MoeForCausalLM(config)


MODELS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[str, ...]]] = {
    "llama": (llama, ("model.layers",)),
    "gemma3": (gemma3, ("model.layers",)),
    "bart": (bart, ("model.encoder.layers", "model.decoder.layers")),
    "qwen3_moe": (qwen3_moe, ("model.layers",)),
}


class VocabModule(L.LightningModule):
    """``MODELS[name]`` (seed 0), its layers pipelined; the model's own loss; SGD."""

    def __init__(self, name: str) -> None:
        super().__init__()
        build, self.layers = MODELS[name]
        torch.manual_seed(0)
        self.model = build()
        self.reads_logits = False

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, *self.layers)

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(**batch)
        logits = out.logits
        # what the step sees: a DTensor split over the vocabulary where the engine splits the head
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        self.logits_seen = (type(logits).__name__, tuple(local.shape))
        if self.reads_logits:  # the next-token accuracy, computed on the logits with the plain labels
            hits = logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]
            self.log("accuracy", hits.float().mean())
        return out.loss

    def validation_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Losses(L.Callback):
    """Each training step's loss, as the step returned it to Lightning (every rank: the step's)."""

    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def batches(name: str, steps: int = 3) -> List[Dict[str, Any]]:
    """``steps`` batches of 4 sequences of 8 tokens, every token a label (each micro-batch's token
    mean then weighs as the whole batch's)."""
    vocab = 32000 if name == "llama" else 256
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, vocab, (4, 8), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def loader(name: str) -> DataLoader:
    return DataLoader(batches(name), batch_size=None)
