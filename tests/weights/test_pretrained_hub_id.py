"""``pipeckpt.pretrained(model, "org/name")``: a Hub id is found in huggingface_hub's local cache, as the
app's ``model.path`` finds it (one resolver: pipeckpt/weights/hub.py), never downloaded, and its
snapshot is confined to its Hub repository folder (issue 45). The cache is a fake one in tmp_path,
laid out as huggingface_hub writes it (tests/app/test_hf_pretrained_dirs.py's ``hub_snapshot``)."""

import os
from pathlib import Path

import huggingface_hub
import pytest
import torch
from support.pretrained_models import keys_read, reference, save
from support.toy import assert_bitwise_equal
from test_hf_pretrained_dirs import hub_snapshot
from test_pretrained_confinement import INDEX, _on_meta

import pipeckpt
from pipeckpt._errors import PipeckptCheckpointError, PipeckptConfigError
from pipeckpt.stages.materialize import materialize


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty huggingface_hub cache, the one huggingface_hub reads for this test."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_hub_id_fills_the_module_from_its_snapshot_in_the_local_cache(tmp_path, cache):
    saved = save("llama", tmp_path / "saved")
    hub_snapshot(saved, cache)
    model = pipeckpt.pretrained(_on_meta(), "org/tiny")
    materialize(model, torch.device("cpu"))
    assert_bitwise_equal(model.state_dict(), reference(saved).state_dict())


def test_a_hub_id_absent_from_the_cache_is_refused_naming_it_and_the_cache(cache):
    with keys_read() as read, pytest.raises(PipeckptConfigError) as error:
        pipeckpt.pretrained(_on_meta(), "org/absent")
    assert read == []
    assert str(error.value).startswith(
        f"pretrained(path='org/absent'): no such file or directory, nor a Hub id in huggingface_hub's "
        f"local cache ({cache}); nothing is downloaded"
    )


def test_a_hub_ids_snapshot_linking_outside_its_repository_folder_is_refused(tmp_path, cache):
    saved = save("llama", tmp_path / "saved")
    snapshot = hub_snapshot(saved, cache)
    (snapshot / INDEX).unlink()
    (snapshot / INDEX).symlink_to(os.path.relpath(saved / INDEX, snapshot))
    with keys_read() as read, pytest.raises(PipeckptCheckpointError) as error:
        pipeckpt.pretrained(_on_meta(), "org/tiny")
    assert read == []
    assert str(error.value).startswith(f"pretrained directory {str(snapshot)!r}: the index names the file")
    assert f"(or its Hub repository folder {str(cache / 'models--org--tiny')!r})" in str(error.value)
