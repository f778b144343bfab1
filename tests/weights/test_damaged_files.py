"""A pretrained directory whose files are damaged is refused when :func:`pipeckpt.pretrained` marks the
module, naming the file and what is wrong with it (pipeckpt/weights/safetensors_header.py, listing.py),
before any tensor is read; never the safetensors library's words, nor a read past the end mid-training."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from support.pretrained_models import config, save

import pipeckpt
from pipeckpt._errors import PipeckptCheckpointError

INDEX = "model.safetensors.index.json"


def _on_meta() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config("llama"), dtype=torch.float32)


def _shard(path: Path) -> Path:
    """The shard holding the embedding (the largest tensor, so the data holds more than its header)."""
    return path / json.loads((path / INDEX).read_text())["weight_map"]["model.embed_tokens.weight"]


def _refusal(path: Path) -> str:
    with pytest.raises(PipeckptCheckpointError) as error:
        pipeckpt.pretrained(_on_meta(), path)
    return str(error.value)


def _with_header(shard: Path, header: bytes) -> None:
    data = shard.read_bytes()
    old = int.from_bytes(data[:8], "little")
    shard.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + old :])


def test_a_truncated_shard_is_named_with_the_bytes_it_lacks(tmp_path):
    shard = _shard(save("llama", tmp_path))
    shard.write_bytes(shard.read_bytes()[:-100])
    message = _refusal(tmp_path)
    assert message.startswith(f"shard {str(shard)!r}: ") and "it is truncated" in message


def test_a_single_weights_file_cut_inside_its_header_is_named(tmp_path):
    transformers.AutoModelForCausalLM.from_config(config("llama")).save_pretrained(tmp_path)
    single = tmp_path / "model.safetensors"
    single.write_bytes(single.read_bytes()[:200])
    message = _refusal(tmp_path)
    assert message.startswith(f"weights file {str(single)!r}: its header should be ")
    assert "truncated" in message


def test_a_header_of_absurd_length_is_named_with_the_length(tmp_path):
    shard = _shard(save("llama", tmp_path))
    data = shard.read_bytes()
    shard.write_bytes((2**62).to_bytes(8, "little") + data[8:])
    assert f"a header of {2**62:,} bytes, over safetensors' bound" in _refusal(tmp_path)


def test_a_header_that_is_not_json_is_named_with_the_parse_error(tmp_path):
    shard = _shard(save("llama", tmp_path))
    _with_header(shard, b'{"model.embed_tokens.weight": {"dtype": "BF16",')
    message = _refusal(tmp_path)
    assert message.startswith(f"shard {str(shard)!r}: its header is not valid JSON (")


def test_a_header_that_is_not_utf8_is_named(tmp_path):
    shard = _shard(save("llama", tmp_path))
    _with_header(shard, b'{"\xff\xfe": 1}')
    assert "its header is not UTF-8 text (byte 2)" in _refusal(tmp_path)


def test_a_header_entry_without_offsets_is_named_with_the_key(tmp_path):
    shard = _shard(save("llama", tmp_path))
    _with_header(
        shard, json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [64, 32]}}).encode()
    )
    assert "its header's entry for 'model.embed_tokens.weight' is " in _refusal(tmp_path)


def test_a_header_whose_shape_disagrees_with_its_bytes_is_named(tmp_path):
    shard = _shard(save("llama", tmp_path))
    entry = {"dtype": "BF16", "shape": [64, 33], "data_offsets": [0, 64 * 32 * 2]}
    _with_header(shard, json.dumps({"model.embed_tokens.weight": entry}).encode())
    assert "gives 'model.embed_tokens.weight' shape (64, 33) in BF16 (4,224 bytes) but 4,096" in _refusal(
        tmp_path
    )


def test_a_shard_the_index_names_that_is_not_there_is_named(tmp_path):
    shard = _shard(save("llama", tmp_path))
    shard.unlink()
    assert _refusal(tmp_path).startswith(f"shard {str(shard)!r}: the file is not there")


def test_an_index_that_is_not_json_is_named_with_line_and_column(tmp_path):
    path = save("llama", tmp_path)
    (path / INDEX).write_text('{"weight_map": {\n  "a": "b",\n}')
    assert _refusal(path).startswith(
        f"index {str(path / INDEX)!r}: it is not valid JSON ("
    ) and "line 3" in _refusal(path)


def test_an_index_without_a_weight_map_is_named(tmp_path):
    path = save("llama", tmp_path)
    (path / INDEX).write_text('{"metadata": {}}')
    assert 'it holds no "weight_map" object' in _refusal(path)
