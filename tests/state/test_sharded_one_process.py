"""Sharded checkpoints (pipeckpt/state/sharded.py) in one process, no group: what it saves loads back
whole or by keys, a save replaces an older checkpoint (swapped in one step, or moved aside), optimizer
state goes between index and name keys, what cannot be saved or loaded is refused by name, and the
converter command writes the plain Lightning checkpoint.

What real ranks write and read back, and a save killed or failing on one of them:
tests/state/test_sharded.py.
"""

import subprocess
import sys
from typing import Any, Dict, Iterator, List

import pytest
import torch
from sharded_worker import build, names
from support.sharded_checkpoints import adam_by_name as _adam_by_name
from support.sharded_checkpoints import equal as _equal
from support.sharded_checkpoints import reference as _reference
from support.sharded_checkpoints import worker_env as _env

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.state import directories, sharded


@pytest.fixture
def small(tmp_path) -> Iterator[Dict[str, Any]]:
    model, optimizer = _reference(1)
    checkpoint = {
        "epoch": 1,
        "state_dict": model.state_dict(),
        "optimizer_states": [_adam_by_name(optimizer, model)],
    }
    yield {"model": model, "optimizer": optimizer, "checkpoint": checkpoint, "path": tmp_path / "c.ckpt"}


def test_is_sharded_tells_a_sharded_directory_from_a_file_and_a_plain_directory(small, tmp_path):
    sharded.save(small["checkpoint"], small["path"])
    torch.save({}, tmp_path / "file.ckpt")
    (tmp_path / "plain").mkdir()
    assert [sharded.is_sharded(p) for p in (small["path"], tmp_path / "file.ckpt", tmp_path / "plain")] == [
        True,
        False,
        False,
    ]
    assert sharded.is_sharded(tmp_path / "missing") is False


def test_without_a_group_one_process_saves_and_loads_everything(small):
    sharded.save(small["checkpoint"], small["path"])
    assert _equal(sharded.load(small["path"]), small["checkpoint"])


def test_optimizer_state_of_any_shape_round_trips(small):
    odd = {"history": [torch.ones(2), [torch.zeros(1), 3]], "note": "x", "none": None, "empty": []}
    small["checkpoint"]["optimizer_states"][0]["state"]["0.weight"] = odd
    sharded.save(small["checkpoint"], small["path"])
    loaded = sharded.load(small["path"], keys=["0.weight"])
    assert _equal(loaded["optimizer_states"][0]["state"], {"0.weight": odd})


def test_a_sharded_checkpoint_replaces_a_single_file_of_the_same_name(small):
    torch.save({"epoch": 0}, small["path"])
    sharded.save(small["checkpoint"], small["path"])
    assert sharded.load(small["path"])["epoch"] == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_a_replacing_save_swaps_the_directories_in_one_step_on_linux(small, monkeypatch):
    swaps: List[bool] = []
    exchange = directories.exchange
    monkeypatch.setattr(directories, "exchange", lambda a, b: swaps.append(exchange(a, b)) or swaps[-1])
    sharded.save(small["checkpoint"], small["path"])
    small["checkpoint"]["epoch"] = 2
    sharded.save(small["checkpoint"], small["path"])
    assert swaps == [True]  # the first save found nothing to swap with
    assert sharded.load(small["path"])["epoch"] == 2
    assert [p.name for p in small["path"].parent.iterdir()] == ["c.ckpt"]


def test_where_the_filesystem_cannot_swap_the_older_one_is_moved_aside_then_removed(small, monkeypatch):
    monkeypatch.setattr(directories, "exchange", lambda a, b: False)
    sharded.save(small["checkpoint"], small["path"])
    small["checkpoint"]["epoch"] = 2
    sharded.save(small["checkpoint"], small["path"])
    assert sharded.load(small["path"])["epoch"] == 2
    assert [p.name for p in small["path"].parent.iterdir()] == ["c.ckpt"]


def test_optimizer_state_by_name_and_by_index_are_inverse(small):
    state = small["optimizer"].state_dict()
    by_name = _adam_by_name(small["optimizer"], small["model"])
    assert "2.bias" not in by_name["state"]  # frozen: no state, no entry
    assert by_name["param_groups"][1]["params"] == ["0.bias", "1.bias", "2.bias", "3.bias"]
    assert _equal(sharded.optimizer_state_by_index(by_name, names(small["model"])), state)


def test_names_that_do_not_match_the_optimizer_are_refused(small):
    state = small["optimizer"].state_dict()
    with pytest.raises(PipeckptConfigError, match=r"3 parameter names for an optimizer of 8 parameters"):
        sharded.optimizer_state_by_name(state, ["a", "b", "c"])
    by_name = _adam_by_name(small["optimizer"], small["model"])
    with pytest.raises(PipeckptConfigError, match=r"\['0.bias'.*does not hold.*HINT"):
        sharded.optimizer_state_by_index(by_name, [n for n in names(small["model"]) if n != "0.bias"])


def test_meta_tensors_are_refused_naming_the_keys(small):
    small["checkpoint"]["state_dict"]["0.weight"] = torch.empty(2, device="meta")
    with pytest.raises(PipeckptConfigError, match=r"\['0.weight'\] on the meta device.*HINT"):
        sharded.save(small["checkpoint"], small["path"])
    assert not small["path"].exists()


def test_index_keyed_optimizer_state_is_refused(small):
    small["checkpoint"]["optimizer_states"] = [small["optimizer"].state_dict()]
    with pytest.raises(PipeckptConfigError, match=r"by parameter name.*optimizer_state_by_name"):
        sharded.save(small["checkpoint"], small["path"])


def test_loading_keys_that_are_not_in_the_checkpoint_names_them(small):
    sharded.save(small["checkpoint"], small["path"])
    with pytest.raises(PipeckptConfigError, match=r"keys \['nope'\]: are not in the sharded checkpoint"):
        sharded.load(small["path"], keys=["0.weight", "nope"])


def test_loading_a_path_that_is_not_sharded_names_it(tmp_path):
    torch.save({}, tmp_path / "file.ckpt")
    with pytest.raises(PipeckptConfigError, match=r"file.ckpt'.*is not a sharded checkpoint directory"):
        sharded.load(tmp_path / "file.ckpt")


def test_converter_command_writes_the_plain_checkpoint(small, tmp_path):
    sharded.save(small["checkpoint"], small["path"])
    out = tmp_path / "plain.ckpt"
    done = subprocess.run(
        [sys.executable, "-m", "pipeckpt.convert", str(small["path"]), str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    plain = torch.load(out, weights_only=False)
    assert _equal(plain["optimizer_states"][0], small["optimizer"].state_dict())
    model, _ = build()
    model.load_state_dict(plain["state_dict"], strict=True)
    assert _equal(model.state_dict(), small["model"].state_dict())


def test_converter_command_names_a_path_that_is_not_sharded(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pipeckpt.convert", str(tmp_path / "nothing"), str(tmp_path / "out.ckpt")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "nothing': is not a sharded checkpoint directory" in done.stderr
    assert not (tmp_path / "out.ckpt").exists()
