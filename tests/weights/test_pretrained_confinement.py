"""A pretrained directory is read only from inside itself, or from its Hub repository folder for a
snapshot of huggingface_hub's cache (pipeckpt/weights/confinement.py): a snapshot of relative links
into ``blobs/`` fills a module as its directory does; a weights file, shard or index linked anywhere
else is refused, naming it, before any tensor is read."""

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from support.pretrained_models import config, keys_read, reference, save
from support.toy import assert_bitwise_equal
from test_hf_pretrained_dirs import hub_snapshot

import pipeckpt
from pipeckpt._errors import PipeckptCheckpointError
from pipeckpt.stages.materialize import materialize

CPU = torch.device("cpu")
INDEX = "model.safetensors.index.json"


def _on_meta() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config("llama"), dtype=torch.float32)


def _refusal(path: Path) -> str:
    with keys_read() as read, pytest.raises(PipeckptCheckpointError) as error:
        pipeckpt.pretrained(_on_meta(), path)
    assert read == []
    return str(error.value)


def _single(path: Path) -> Path:
    torch.manual_seed(4)
    transformers.AutoModelForCausalLM.from_config(config("llama")).save_pretrained(path)
    return path


def test_a_hub_snapshot_of_links_into_its_blobs_fills_the_module_as_its_directory_does(tmp_path):
    path = save("llama", tmp_path / "saved")
    snapshot = hub_snapshot(path, tmp_path / "hub")
    assert (snapshot / INDEX).is_symlink()
    model = pipeckpt.pretrained(_on_meta(), snapshot)
    materialize(model, CPU)
    assert_bitwise_equal(model.state_dict(), reference(path).state_dict())


def test_a_single_weights_file_of_a_snapshot_is_read_through_its_link(tmp_path):
    snapshot = hub_snapshot(_single(tmp_path / "saved"), tmp_path / "hub")
    model = pipeckpt.pretrained(_on_meta(), snapshot)
    materialize(model, CPU)
    assert_bitwise_equal(model.state_dict(), reference(tmp_path / "saved").state_dict())


def test_a_single_weights_file_linked_outside_the_directory_is_refused(tmp_path):
    other = _single(tmp_path / "other")
    path = tmp_path / "d"
    path.mkdir()
    (path / "config.json").write_text((other / "config.json").read_text())
    (path / "model.safetensors").symlink_to(other / "model.safetensors")
    message = _refusal(path)
    assert message.startswith(f"pretrained directory {str(path)!r}: the weights file model.safetensors names")
    assert "is a symbolic link (or lies under one) that leads to" in message


def test_a_shard_linked_outside_the_directory_is_refused(tmp_path):
    path = save("llama", tmp_path / "d")
    shard = json.loads((path / INDEX).read_text())["weight_map"]["lm_head.weight"]
    (tmp_path / "elsewhere.safetensors").write_bytes((path / shard).read_bytes())
    (path / shard).unlink()
    (path / shard).symlink_to(tmp_path / "elsewhere.safetensors")
    assert f"{INDEX}'s weight_map names the file '{shard}', which is a symbolic link" in _refusal(path)


def test_a_snapshot_link_that_leaves_its_repository_folder_is_refused(tmp_path):
    snapshot = hub_snapshot(save("llama", tmp_path / "saved"), tmp_path / "hub")
    (snapshot / INDEX).unlink()
    (snapshot / INDEX).symlink_to(os.path.relpath(tmp_path / "saved" / INDEX, snapshot))
    message = _refusal(snapshot)
    assert message.startswith(f"pretrained directory {str(snapshot)!r}: the index names the file '{INDEX}'")
    assert f"(or its Hub repository folder {str(tmp_path / 'hub' / 'models--org--tiny')!r})" in message


def test_an_index_entry_with_an_absolute_path_is_refused(tmp_path):
    path = save("llama", tmp_path / "d")
    index = json.loads((path / INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = str(path / index["weight_map"]["lm_head.weight"])
    (path / INDEX).write_text(json.dumps(index))
    assert "is an absolute path" in _refusal(path)
