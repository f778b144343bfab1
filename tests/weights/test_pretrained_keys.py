"""A module against its pretrained directory, checked when :func:`pipeckpt.pretrained` marks it, from
the index and the safetensors headers alone (pipeckpt/weights/matching.py, listing.py): keys the
module takes and the shards do not hold, keys no tensor takes, and index entries that name the wrong
shard, each refused or followed by name before any tensor is read."""

import json
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from support.pretrained_models import config, keys_read, reference, save
from support.toy import assert_bitwise_equal

import pipeckpt
from pipeckpt._errors import PipeckptCheckpointError, PipeckptConfigError, PipeckptWarning
from pipeckpt.stages.materialize import materialize

CPU = torch.device("cpu")
INDEX = "model.safetensors.index.json"


def _on_meta(name: str, **fields) -> torch.nn.Module:
    built = config(name).__class__(**{**config(name).to_dict(), **fields})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(built, dtype=torch.float32)


def _rewrite_index(path: Path, change) -> None:
    index = json.loads((path / INDEX).read_text())
    change(index["weight_map"])
    (path / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("name, layers", [("llama", "model.layers"), ("gpt2", "transformer.h")])
def test_a_config_of_fewer_layers_than_the_shards_hold_is_refused_naming_both_counts(tmp_path, name, layers):
    path = save(name, tmp_path)  # 4 layers
    fewer = {"n_layer": 2} if name == "gpt2" else {"num_hidden_layers": 2}
    with pytest.raises(
        PipeckptConfigError, match=rf"no tensor of .* takes.*holds 4 of {layers}, the module 2"
    ):
        pipeckpt.pretrained(_on_meta(name, **fewer), path)


def test_a_config_of_more_layers_than_the_shards_hold_is_refused_naming_both_counts(tmp_path):
    path = save("llama", tmp_path)
    with pytest.raises(
        PipeckptConfigError, match=r"lacks model\.layers\.4\..*holds 4 of model\.layers, the module 6"
    ):
        pipeckpt.pretrained(_on_meta("llama", num_hidden_layers=6), path)


def test_the_refusal_comes_before_any_tensor_is_read(tmp_path):
    path = save("llama", tmp_path)
    with keys_read() as read, pytest.raises(PipeckptConfigError):
        pipeckpt.pretrained(_on_meta("llama", num_hidden_layers=2), path)
    assert read == []


def test_keys_the_user_ignores_are_left_unread(tmp_path):
    path = save("llama", tmp_path)
    model = pipeckpt.pretrained(
        _on_meta("llama", num_hidden_layers=2), path, ignore=[r"^model\.layers\.[23]\."]
    )
    with keys_read() as read:
        materialize(model, CPU)
    assert not any(k.startswith(("model.layers.2.", "model.layers.3.")) for k in read)
    want = {k: v for k, v in reference(path).state_dict().items() if k in model.state_dict()}
    assert_bitwise_equal(model.state_dict(), want)


def test_the_models_own_keys_to_ignore_on_load_unexpected_are_left_unread(tmp_path):
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(config("gpt2"))
    weights = {k: v.contiguous() for k, v in eager.state_dict().items() if k != "lm_head.weight"}
    weights["transformer.h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # old GPT-2 checkpoints hold the mask
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    model = pipeckpt.pretrained(_on_meta("gpt2"), tmp_path)
    materialize(model, CPU)
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, eager.transformer.h[0].attn.c_attn.weight)


def test_a_base_model_reads_the_checkpoint_of_the_model_around_it_leaving_the_head(tmp_path):
    path = save("llama", tmp_path)
    with torch.device("meta"):
        base = transformers.AutoModel.from_config(config("llama"), dtype=torch.float32)
    materialize(pipeckpt.pretrained(base, path), CPU)
    assert_bitwise_equal(base.state_dict(), reference(path).model.state_dict())


def test_an_index_entry_naming_a_shard_without_the_key_is_followed_to_the_shard_that_holds_it(tmp_path):
    path = save("llama", tmp_path)
    key = "lm_head.weight"
    _rewrite_index(path, lambda m: m.update({key: next(f for f in m.values() if f != m[key])}))
    with pytest.warns(PipeckptWarning, match=rf"maps '{key}' to .* which does not hold it; reading it from"):
        model = pipeckpt.pretrained(_on_meta("llama"), path)
    materialize(model, CPU)
    assert_bitwise_equal(model.state_dict(), reference(save("llama", tmp_path / "intact")).state_dict())


def test_a_damaged_file_the_index_does_not_list_is_passed_over_while_following_an_entry(tmp_path):
    path = save("llama", tmp_path)
    (path / "stray.safetensors").write_bytes(b"not a safetensors file")
    key = "lm_head.weight"
    _rewrite_index(path, lambda m: m.update({key: next(f for f in m.values() if f != m[key])}))
    with pytest.warns(PipeckptWarning, match=rf"maps '{key}' to "):
        model = pipeckpt.pretrained(_on_meta("llama"), path)
    materialize(model, CPU)
    assert torch.equal(model.lm_head.weight, reference(save("llama", tmp_path / "intact")).lm_head.weight)


def test_an_index_entry_that_no_shard_holds_is_refused_naming_the_key_and_shard(tmp_path):
    path = save("llama", tmp_path)
    _rewrite_index(path, lambda m: m.update({"model.extra.weight": m["lm_head.weight"]}))
    with pytest.raises(
        PipeckptCheckpointError,
        match=r"maps 'model\.extra\.weight' to the shard 'model-\d+.*nor does any other shard",
    ):
        pipeckpt.pretrained(_on_meta("llama"), path)


def test_a_key_two_shards_hold_where_the_index_names_neither_is_refused(tmp_path):
    path = save("llama", tmp_path)
    head = torch.zeros(64, 32, dtype=torch.bfloat16)
    for name in ("a", "b"):
        safetensors.torch.save_file(
            {"lm_head.weight": head, name: head.clone()}, str(path / f"{name}.safetensors")
        )
    holder = json.loads((path / INDEX).read_text())["weight_map"]["lm_head.weight"]
    other = next(f for f in json.loads((path / INDEX).read_text())["weight_map"].values() if f != holder)
    _rewrite_index(
        path, lambda m: m.update({"lm_head.weight": other, "a": "a.safetensors", "b": "b.safetensors"})
    )
    with pytest.raises(
        PipeckptCheckpointError,
        match=rf"the shards .* all hold 'lm_head\.weight' and the index names '{other}'",
    ):
        pipeckpt.pretrained(_on_meta("llama"), path)


def test_an_intact_directory_is_marked_without_a_warning(tmp_path):
    path = save("qwen2", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipeckptWarning)
        pipeckpt.pretrained(_on_meta("qwen2"), path)
