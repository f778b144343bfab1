"""Selective checkpointing (and every recomputing mode) on Hugging Face models built as their users
build them, KV cache on (the configs' default): GPT-2, Llama, Qwen2, BERT (as a decoder) and T5,
pipelined with ``pipeline_of`` into 2 stages and trained by a real Trainer with dropout on, end
with parameters bitwise equal to ``never``. The model's forward hands every layer one KV cache,
which a recompute would fill a second time: a recomputed layer call runs without it."""

from typing import Any, Dict

import pytest
import torch
from support.hf_zoo import NAMES, hf_data, hf_module
from torch import Tensor

import pipeckpt
from pipeckpt.checkpointing.kv_caches import without_kv_caches

pytest.importorskip("transformers")


def trained(quiet_trainer: Any, name: str, mode: Any, steps: int = 2) -> Dict[str, Tensor]:
    module = hf_module(name, dropout=0.1)
    strategy = pipeckpt.PipelineStrategy(stages=2, chunks=4, checkpoint=mode)
    quiet_trainer(strategy, max_steps=steps).fit(module, hf_data())
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_bitwise(got: Dict[str, Tensor], expected: Dict[str, Tensor], what: str) -> None:
    assert got.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"{what}: {len(differ)} tensors differ from never, e.g. {differ[:3]}"


# Plain recomputes ran before, and silently differed (a recompute attended over the keys twice).
MODES = {"gpt2": ["always"], "t5": ["always"]}


@pytest.mark.parametrize("name", NAMES)
def test_selective_trains_bitwise_equal_to_never_with_dropout_and_the_cache_on(quiet_trainer, name):
    assert hf_module(name).model.config.use_cache  # as its users build it
    never = trained(quiet_trainer, name, "never")
    for mode in ["selective", "selective:1", *MODES.get(name, [])]:
        assert_bitwise(trained(quiet_trainer, name, mode), never, f"{name} {mode}")


def test_only_a_transformers_cache_is_dropped_and_a_reading_layer_keeps_it():
    from transformers import DynamicCache, EncoderDecoderCache

    cache, both, other = DynamicCache(), EncoderDecoderCache(DynamicCache(), DynamicCache()), object()
    layer = hf_module("gpt2").model.transformer.h[0]
    args, kwargs = without_kv_caches(layer.forward, (1, cache, other), {"past_key_values": both, "x": other})
    assert args == (1, None, other) and kwargs == {"past_key_values": None, "x": other}
    plain = (1, other), {"x": other}
    assert without_kv_caches(layer.forward, *plain)[0] is plain[0]  # the very objects: nothing to drop
    layer._can_checkpoint_with_cache = True  # HF's flag for a layer that only reads the cache
    assert without_kv_caches(layer.forward, (cache,), {})[0][0] is cache
