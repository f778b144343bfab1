"""A sharded checkpoint's two index files (DCP's ``.metadata``, rank 0's ``pipeckpt-meta.pt``) are
read once per use: by a load, by a resume under the distributed engine (which checks the index
against the module, then reads its keys), and by an export that reads the weights in many groups.
One index serves any number of loads, and none of them changes it. An audit hook records every
file this process opens; one read of the index opens rank 0's file three times (its header, its
zip directory, then ``torch.load``), so each use is held to the opens of one ``read_index``."""

import copy
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, List

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from pipeckpt.app.models import GPT
from pipeckpt.engines.base import optimizer_param_names
from pipeckpt.engines.distributed.state import StateIO
from pipeckpt.state import sharded
from pipeckpt.state.sharded_index import DCP_METADATA, META_FILE, read_index

SMALL = dict(size="tiny", vocab_size=32, seq_len=8, d_model=16, n_heads=2)
INDEX_FILES = (DCP_METADATA, META_FILE)

_opened: List[str] = []


def _audit(event: str, args: Any) -> None:
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        _opened.append(os.path.realpath(os.fspath(args[0])))


sys.addaudithook(_audit)  # cannot be removed; it only appends to a list


@pytest.fixture
def opened() -> Iterator[List[str]]:
    _opened.clear()
    yield _opened


def index_opens(opened: List[str], root: Path) -> Counter:
    """How often each index file of the checkpoint at ``root`` was opened."""
    names = {os.path.realpath(root / name): name for name in INDEX_FILES}
    return Counter(names[path] for path in opened if path in names)


def read_once(root: Path) -> Counter:
    """The opens of one read of ``root``'s index."""
    _opened.clear()
    read_index(root)
    once = index_opens(_opened, root)
    _opened.clear()
    assert once[DCP_METADATA] == 1 and once[META_FILE] >= 1, once
    return once


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A GPT's sharded checkpoint after one AdamW step, optimizer state keyed by name as the
    distributed engine writes it."""
    torch.manual_seed(0)
    module = GPT(**SMALL)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randint(0, 32, (2, 8))).float().mean().backward()
    optimizer.step()
    names = optimizer_param_names(module, optimizer)
    state = {
        "state_dict": module.state_dict(),
        "hyper_parameters": dict(module.hparams),
        "optimizer_states": [sharded.optimizer_state_by_name(optimizer.state_dict(), names)],
        "global_step": 1,
    }
    sharded.save(state, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_a_load_reads_the_index_once(checkpoint, opened):
    once = read_once(checkpoint)
    sharded.load(checkpoint)
    assert index_opens(opened, checkpoint) == once


def test_a_resume_under_the_distributed_engine_reads_the_index_once(checkpoint, opened):
    module = GPT(**SMALL)
    once = read_once(checkpoint)
    state = StateIO.load(checkpoint, module, TorchCheckpointIO(), None)
    assert index_opens(opened, checkpoint) == once
    assert set(state["state_dict"]) == set(module.state_dict())  # and it read the module's keys


def test_one_index_serves_many_loads_and_none_changes_it(checkpoint, opened):
    once = read_once(checkpoint)
    index = read_index(checkpoint)
    before = copy.deepcopy(index.rest)
    keys = list(GPT(**SMALL).state_dict())
    first = sharded.load(checkpoint, keys=keys[:3], index=index)
    second = sharded.load(checkpoint, keys=keys[3:], index=index)
    assert index_opens(opened, checkpoint) == once
    assert index.rest.keys() == before.keys() and index.rest["optimizer_states"] == before["optimizer_states"]
    whole = sharded.load(checkpoint)
    for part, wanted in ((first, keys[:3]), (second, keys[3:])):
        assert list(part["state_dict"]) == wanted
        assert all(torch.equal(part["state_dict"][k], whole["state_dict"][k]) for k in wanted)
        (states,) = [o["state"] for o in part["optimizer_states"]]
        assert set(states) == {k for k in wanted if k in whole["optimizer_states"][0]["state"]}
    assert "pipeckpt_sharded_format" not in whole  # the format mark stays in the file


def test_an_export_in_many_groups_reads_the_index_once(tmp_path, opened, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from pipeckpt.export import export_hf
    from pipeckpt.export import hf as export_hf_module

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    sharded.save({"state_dict": state, "global_step": 0}, tmp_path / "ckpt")
    monkeypatch.setattr(export_hf_module, "READ_BYTES", 4096)  # a group of a tensor or two
    reads: List[int] = []
    load = sharded.load
    monkeypatch.setattr(sharded, "load", lambda path, **kw: reads.append(1) or load(path, **kw))
    once = read_once(tmp_path / "ckpt")
    out = export_hf(
        tmp_path / "ckpt", tmp_path / "hf", prefix="model.", config=config, model_class=type(model)
    )
    assert len(reads) > 10  # many groups, one load each
    assert index_opens(opened, tmp_path / "ckpt") == once
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
