"""A checkpoint reads only inside itself (pipeckpt/state/confined.py): a sharded directory whose
index names a file outside it (an absolute path, a ``..``), or whose shard, index or rank-0 part is
a symbolic link to a file outside it, is refused naming the entry and the path, before any byte of
the outside file is read, under every load path: ``sharded.load``, ``Trainer.fit(ckpt_path=)``
under both engines, and ``python -m pipeckpt.convert``.

The planted file holds another model's weights under the same layout, so a load that read it would
succeed with other numbers; an audit hook records every file this process opens.
"""

import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import support.ranks as ranks
import torch
from support.toy import ToyModule, fit, params
from torch.distributed.checkpoint.metadata import Metadata

from pipeckpt import PipeckptCheckpointError, PipelineStrategy
from pipeckpt import convert as convert_cli
from pipeckpt.engines.base import optimizer_param_names
from pipeckpt.state import safe_load, sharded

HERE = Path(__file__).resolve().parent
DISTRIBUTED_WORKER = HERE.parent / "engines" / "distributed" / "distributed_worker.py"
SHARD = "__0_0.distcp"  # the one shard a single process's save writes
STRATEGY = dict(balance=[3, 3], chunks=4)

_opened: List[str] = []


def _audit(event: str, args: Any) -> None:
    """Records the real path of every file this process opens (Python's ``open`` event)."""
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        _opened.append(os.path.realpath(os.fspath(args[0])))


sys.addaudithook(_audit)  # cannot be removed; it only appends to a list


def _save_sharded(module: ToyModule, out: Path) -> Path:
    """``module``'s checkpoint after 2 local steps, as the distributed engine writes it."""
    trainer = fit(module, PipelineStrategy(**STRATEGY), steps=2)
    trainer.save_checkpoint(out.with_suffix(".ckpt"))
    checkpoint = torch.load(out.with_suffix(".ckpt"), weights_only=True)
    names = optimizer_param_names(module, module.configure_optimizers())
    checkpoint["optimizer_states"] = [
        sharded.optimizer_state_by_name(checkpoint["optimizer_states"][0], names)
    ]
    sharded.save(checkpoint, out)
    return out


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> Dict[str, Path]:
    """A checkpoint, and another model's of the same layout (what a planted file would load)."""
    base = tmp_path_factory.mktemp("originals")
    return {
        "mine": _save_sharded(ToyModule(seed=0), base / "mine"),
        "other": _save_sharded(ToyModule(seed=99), base / "other"),
    }


@pytest.fixture
def outside(originals, tmp_path) -> Path:
    """The other model's shard, in a folder beside the checkpoint."""
    folder = tmp_path / "outside"
    folder.mkdir()
    shutil.copy(originals["other"] / SHARD, folder / "weights.distcp")
    return folder / "weights.distcp"


@pytest.fixture
def checkpoint(originals, tmp_path) -> Path:
    return Path(shutil.copytree(originals["mine"], tmp_path / "ckpt", symlinks=True))


def _rewrite_index(root: Path, name: Callable[[str], str]) -> None:
    """DCP's index of ``root`` with every entry's file renamed by ``name`` (pickled as DCP does)."""
    metadata: Metadata = safe_load.read_dcp_metadata(root / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = name(info.relative_path)
    with open(root / ".metadata", "wb") as file:
        pickle.dump(metadata, file)


def plant_absolute(root: Path, outside: Path) -> None:
    _rewrite_index(root, lambda _: str(outside))


def plant_dotdot(root: Path, outside: Path) -> None:
    _rewrite_index(root, lambda _: os.path.relpath(outside, root))


def plant_symlinked_shard(root: Path, outside: Path) -> None:
    (root / SHARD).unlink()
    (root / SHARD).symlink_to(outside)


def plant_symlinked_index(root: Path, outside: Path) -> None:
    """The index is a link to an index outside, which names the outside shard by its path."""
    index = outside.parent / ".metadata"
    shutil.copy(root / ".metadata", index)
    _rewrite_index(outside.parent, lambda _: str(outside))
    (root / ".metadata").unlink()
    (root / ".metadata").symlink_to(index)


def plant_symlinked_rest(root: Path, outside: Path) -> None:
    """Rank 0's part (loops, callbacks, optimizer groups) is a link to a file outside."""
    rest = outside.parent / "rest.pt"
    shutil.copy(root / sharded.META_FILE, rest)
    (root / sharded.META_FILE).unlink()
    (root / sharded.META_FILE).symlink_to(rest)


PLANTS = {
    "absolute": (plant_absolute, "is an absolute path"),
    "dotdot": (plant_dotdot, "outside the directory"),
    "symlinked_shard": (plant_symlinked_shard, "is a symbolic link"),
    "symlinked_index": (plant_symlinked_index, "is a symbolic link"),
    "symlinked_rest": (plant_symlinked_rest, "is a symbolic link"),
}


def _outside_reads(outside: Path) -> List[str]:
    folder = os.path.realpath(outside.parent)
    return [path for path in _opened if os.path.commonpath([folder, path]) == folder]


@pytest.mark.parametrize("plant", PLANTS)
def test_sharded_load_refuses_a_file_outside_the_checkpoint_and_reads_none_of_it(plant, checkpoint, outside):
    make, how = PLANTS[plant]
    make(checkpoint, outside)
    del _opened[:]
    with pytest.raises(PipeckptCheckpointError) as refused:
        sharded.load(checkpoint)
    message = str(refused.value)
    assert how in message and str(checkpoint) in message and "HINT" in message, message
    assert _outside_reads(outside) == []


def test_a_refused_storage_entry_is_named_by_the_modules_own_key(checkpoint, outside):
    plant_absolute(checkpoint, outside)
    with pytest.raises(PipeckptCheckpointError, match=r"the storage entry of '[\w.]+(weight|bias)'"):
        sharded.load(checkpoint)


def test_a_link_to_a_file_inside_the_checkpoint_loads_as_the_file_itself(checkpoint, originals):
    (checkpoint / "shards").mkdir()
    (checkpoint / SHARD).rename(checkpoint / "shards" / SHARD)
    (checkpoint / SHARD).symlink_to(Path("shards") / SHARD)
    got = sharded.load(checkpoint)["state_dict"]
    want = sharded.load(originals["mine"])["state_dict"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("plant", ["absolute", "symlinked_shard"])
def test_resuming_under_the_local_engine_refuses_before_any_step(plant, checkpoint, outside):
    PLANTS[plant][0](checkpoint, outside)
    module = ToyModule(seed=5)
    before = params(module)
    del _opened[:]
    with pytest.raises(PipeckptCheckpointError, match=r"absolute path|symbolic link"):
        fit(module, PipelineStrategy(**STRATEGY), steps=4, ckpt_path=checkpoint)
    assert _outside_reads(outside) == []
    after = params(module)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no step, no weights loaded


def test_convert_refuses_with_its_usage_error_and_writes_nothing(checkpoint, outside, tmp_path, capsys):
    plant_dotdot(checkpoint, outside)
    del _opened[:]
    with pytest.raises(SystemExit) as exited:
        convert_cli.main([str(checkpoint), str(tmp_path / "out.ckpt")])
    assert exited.value.code == 2
    assert "outside the directory" in capsys.readouterr().err
    assert not (tmp_path / "out.ckpt").exists() and _outside_reads(outside) == []


@pytest.mark.slow
def test_resuming_under_the_distributed_engine_refuses_on_every_rank(checkpoint, outside, tmp_path):
    plant_absolute(checkpoint, outside)
    out = tmp_path / "run"
    out.mkdir()
    runs = [dict(name="crafted", strategy=dict(STRATEGY, schedule="1f1b"), steps=4, resume=str(checkpoint))]
    codes = ranks.exit_codes(DISTRIBUTED_WORKER, 2, runs, out, within_s=240)
    output = ranks.logs(out, 2)
    assert [code != 0 for code in codes] == [True, True], output
    for rank in range(2):
        log = (out / f"rank{rank}.log").read_text()
        assert "is an absolute path" in log and str(outside) in log, output
    assert not (out / "crafted.ckpt").exists()


@pytest.mark.slow
def test_train_py_refuses_the_checkpoint_with_exit_1_and_no_traceback(checkpoint, outside, tmp_path):
    from test_train_e2e import train

    plant_symlinked_shard(checkpoint, outside)
    done = train(tmp_path / "run", f"ckpt_path={checkpoint}", check=False)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "is a symbolic link" in done.stderr and SHARD in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
