"""A module built on the meta device, filled from a pretrained checkpoint where it is made real
(pipeckpt/weights/pretrained.py): bitwise what ``from_pretrained(dir, dtype=float32)`` makes of a
bf16 directory in many shards, tied weights tied, buffers the checkpoint lacks from the module's own
code; a process that keeps some tensors reads exactly those keys; plain state-dict files and HF's
prefix rule too; what cannot fill the module is refused by name."""

import json
from pathlib import Path

import pytest
import safetensors
import torch
import transformers
from support.pretrained_models import config, keys_read, reference, save
from support.toy import assert_bitwise_equal

import pipeckpt
from pipeckpt._errors import PipeckptConfigError
from pipeckpt.stages.materialize import materialize

CPU = torch.device("cpu")


def _on_meta(path: Path, kind=transformers.AutoModelForCausalLM, **kwargs) -> torch.nn.Module:
    with torch.device("meta"):
        return kind.from_config(transformers.AutoConfig.from_pretrained(path), dtype=torch.float32, **kwargs)


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def saved(request, tmp_path_factory):
    return request.param, save(request.param, tmp_path_factory.mktemp(request.param))


def test_the_directory_is_saved_in_bf16_in_at_least_eight_shards(saved):
    _, path = saved
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 8
    with safetensors.safe_open(str(path / next(iter(index["weight_map"].values()))), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16


def test_a_whole_module_equals_from_pretrained_in_float32_bitwise_buffers_included(saved):
    _, path = saved
    model = pipeckpt.pretrained(_on_meta(path), path)
    materialize(model, CPU)
    want = reference(path)
    assert_bitwise_equal(model.state_dict(), want.state_dict())
    buffers = dict(want.named_buffers())
    assert_bitwise_equal(dict(model.named_buffers()), buffers)  # rotary frequencies from the module's code
    assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())


def test_tied_weights_stay_one_parameter(saved):
    name, path = saved
    model = pipeckpt.pretrained(_on_meta(path), path)
    materialize(model, CPU)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (name == "gpt2")


def test_the_generators_do_not_move(saved):
    _, path = saved
    model = pipeckpt.pretrained(_on_meta(path), path)
    before = torch.get_rng_state()
    materialize(model, CPU)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_process_keeping_some_layers_reads_exactly_their_keys(saved):
    name, path = saved
    model = pipeckpt.pretrained(_on_meta(path), path)
    layers = model.transformer.h if name == "gpt2" else model.model.layers
    kept = {id(t) for t in (*layers[2:].parameters(), *layers[2:].buffers())}
    with keys_read() as read:
        materialize(model, CPU, keep=lambda t: id(t) in kept)
    prefix = "transformer.h" if name == "gpt2" else "model.layers"
    want = {k for k in reference(path).state_dict() if k.startswith((f"{prefix}.2.", f"{prefix}.3."))}
    assert sorted(read) == sorted(want)
    real = {k: v for k, v in model.state_dict().items() if not v.is_meta}
    assert_bitwise_equal(real, {k: v for k, v in reference(path).state_dict().items() if k in real})
    assert set(real) == want


def test_a_single_safetensors_file_and_a_plain_state_dict_file_fill_alike(tmp_path):
    torch.manual_seed(2)
    eager = transformers.LlamaForCausalLM(config("llama"))
    eager.save_pretrained(tmp_path / "single")  # one model.safetensors
    torch.save(eager.state_dict(), tmp_path / "weights.pt")
    for source in (tmp_path / "single", tmp_path / "single" / "model.safetensors", tmp_path / "weights.pt"):
        model = pipeckpt.pretrained(_on_meta(tmp_path / "single"), source)
        materialize(model, CPU)
        assert_bitwise_equal(model.state_dict(), eager.state_dict())


def test_a_checkpoint_of_the_base_model_fills_the_model_around_it_and_back(tmp_path):
    torch.manual_seed(3)
    whole = transformers.LlamaForCausalLM(config("llama"))
    whole.save_pretrained(tmp_path / "whole")
    whole.model.save_pretrained(tmp_path / "base")  # keys without "model."
    base = pipeckpt.pretrained(_on_meta(tmp_path / "whole", transformers.AutoModel), tmp_path / "whole")
    materialize(base, CPU)
    assert_bitwise_equal(base.state_dict(), whole.model.state_dict())
    model = pipeckpt.pretrained(_on_meta(tmp_path / "whole"), tmp_path / "base", missing="init")
    materialize(model, CPU)
    assert_bitwise_equal(model.model.state_dict(), whole.model.state_dict())


def test_a_weight_the_checkpoint_lacks_is_named_when_the_module_is_marked(tmp_path):
    torch.manual_seed(3)
    whole = transformers.LlamaForCausalLM(config("llama"))
    whole.model.save_pretrained(tmp_path)  # no lm_head.weight
    with pytest.raises(
        PipeckptConfigError, match=r"lacks lm_head\.weight of LlamaForCausalLM.*missing='init'"
    ):
        pipeckpt.pretrained(_on_meta(tmp_path), tmp_path)


def test_missing_init_initialises_the_weights_the_checkpoint_lacks_as_a_build_from_scratch(tmp_path):
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config("llama")).model.save_pretrained(tmp_path)
    model = pipeckpt.pretrained(_on_meta(tmp_path), tmp_path, missing="init")
    materialize(model, CPU)
    head = model.lm_head.weight
    assert not head.is_meta and not torch.isnan(head).any()
    assert abs(head.std().item() - config("llama").initializer_range) < 0.005  # HF's normal(0, 0.02)


def test_a_shape_that_differs_is_named_with_both_shapes_when_the_module_is_marked(tmp_path):
    path = save("llama", tmp_path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(
            config("llama").__class__(**{**config("llama").to_dict(), "vocab_size": 80})
        )
    with pytest.raises(
        PipeckptConfigError,
        match=r"model\.embed_tokens\.weight in .* has shape \(64, 32\), the module's \(80, 32\)",
    ):
        pipeckpt.pretrained(model, path)


def test_a_path_without_a_checkpoint_is_refused_by_name(tmp_path):
    model = _on_meta(save("llama", tmp_path / "d"))
    with pytest.raises(PipeckptConfigError, match=r"a directory without them.*save_pretrained"):
        pipeckpt.pretrained(model, tmp_path)


def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path):
    path = save("llama", tmp_path / "d")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../elsewhere.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PipeckptConfigError, match="outside the directory"):
        materialize(pipeckpt.pretrained(_on_meta(path), path), CPU)


def test_missing_takes_error_or_init_only():
    with pytest.raises(PipeckptConfigError, match=r"pretrained\(missing='zero'\)"):
        with torch.device("meta"):
            pipeckpt.pretrained(torch.nn.Linear(2, 2), "x", missing="zero")


def test_a_module_built_eagerly_is_refused_as_nothing_would_fill_it(tmp_path):
    with pytest.raises(
        PipeckptConfigError,
        match=r"pretrained\(Linear, .*\) on a module whose tensors are real.*configure_model",
    ):
        pipeckpt.pretrained(torch.nn.Linear(2, 2), tmp_path)
