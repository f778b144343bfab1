"""``layer_rng='auto'`` covers random draws that no dropout module holds: a functional call inside a
layer (``F.scaled_dot_product_attention(dropout_p=...)``, ``F.dropout``), as in Hugging Face Llama's and
Qwen2's attention. The masks are then the same under every layout and caller's seed, as under
``'all'``. In one process: the local engine built without a Trainer, one training call's gradients."""

from typing import Any, Dict, List

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from support.toy import assert_bitwise_equal, max_relative_difference
from torch import Tensor, nn

from pipeckpt import pipeline_of
from pipeckpt.engines.local import LocalEngine
from pipeckpt.settings import PipeSettings

CPU = [torch.device("cpu")]


class Attention(nn.Module):
    """Self-attention whose dropout is a float, handed to torch's functional calls (no module)."""

    def __init__(self, width: int = 8, dropout: float = 0.3) -> None:
        super().__init__()
        self.qkv, self.out, self.dropout = nn.Linear(width, 3 * width), nn.Linear(width, width), dropout

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        p = self.dropout if self.training else 0.0
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=p).squeeze(1)
        return x + F.dropout(self.out(h), p, self.training)


def _gradients(balance: List[int], caller_seed: int, **settings: Any) -> Dict[str, Tensor]:
    torch.manual_seed(0)
    layers = nn.Sequential(*(Attention() for _ in range(4)))
    module = L.LightningModule()
    module.layers = layers
    engine = LocalEngine(PipeSettings(chunks=2, balance=balance, **settings))
    engine.build(module, layers, CPU)
    torch.manual_seed(caller_seed)
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))
    layers(x).pow(2).mean().backward()
    return {k: p.grad.clone() for k, p in layers.named_parameters()}


def test_auto_gives_functional_dropout_inside_a_layer_the_same_masks_under_every_layout():
    assert_bitwise_equal(_gradients([2, 2], caller_seed=2), _gradients([4], caller_seed=1))


def test_without_streams_functional_dropout_follows_the_callers_generator():
    # The comparison above with layer_rng='off' fails: the test above can fail.
    one, two = _gradients([4], 1, layer_rng="off"), _gradients([2, 2], 2, layer_rng="off")
    assert max_relative_difference(two, one) > 1e-3


def test_hf_llama_attention_dropout_draws_the_same_masks_under_every_layout():
    transformers = pytest.importorskip("transformers")

    def gradients(balance: List[int], caller_seed: int) -> Dict[str, Tensor]:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
            attention_dropout=0.3, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config).train()
        module = L.LightningModule()
        module.model = model
        engine = LocalEngine(PipeSettings(chunks=2, balance=balance))
        engine.build(module, pipeline_of(model, "model.layers"), CPU)
        assert len(engine.layer_rng.drawing_layers) == 0  # not known before a training call
        torch.manual_seed(caller_seed)
        ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        assert len(engine.layer_rng.drawing_layers) == 4  # every decoder layer drew: it is seeded
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    assert_bitwise_equal(gradients([2, 2], caller_seed=2), gradients([4], caller_seed=1))
