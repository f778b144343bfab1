"""Sharded checkpoints (pipeckpt/state/sharded.py) written by real ranks: each rank writes its own
stages' tensors, a replicated tensor is written once, load reads only what is asked, the converter gives
the plain Lightning checkpoint, and a checkpoint at its path is never a half-written one.

The tests start real gloo processes (tests/state/sharded_worker.py) and kill them at the end. What one
process alone saves, loads, refuses and converts: tests/state/test_sharded_one_process.py.
"""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from sharded_worker import STAGES, build, train
from support import ranks
from support.paths import REPO
from support.sharded_checkpoints import adam_by_name as _adam_by_name
from support.sharded_checkpoints import equal as _equal
from support.sharded_checkpoints import reference as _reference
from support.sharded_checkpoints import worker_env as _env
from torch.distributed.checkpoint import FileSystemReader

from pipeckpt._errors import PipeckptCheckpointError
from pipeckpt.state import sharded

HERE = Path(__file__).resolve().parent
WORKER = HERE / "sharded_worker.py"
DEADLINE_S = 240  # 4 processes starting torch on 2 shared cores


# -- processes -----------------------------------------------------------------------------------


def _run_pipeline(world: int, out: Path) -> Path:
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ranks.free_port()), WORLD_SIZE=str(world))
    procs: List[ranks.Rank] = []
    try:
        for rank in range(world):
            log = out / f"rank{rank}.log"
            procs.append(
                ranks.spawn(WORKER, ["pipeline", str(out)], dict(env, RANK=str(rank)), rank, REPO, log)
            )
        deadline = time.time() + DEADLINE_S
        for p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        ranks.stop(procs)
    logs = "\n".join(f"--- rank {r}\n{(out / f'rank{r}.log').read_text()[-4000:]}" for r in range(world))
    assert [p.returncode for p in procs] == [0] * world, logs
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    return _run_pipeline(2, tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Path:
    return _run_pipeline(4, tmp_path_factory.mktemp("four_ranks"))


def _seen(out: Path, rank: int) -> Dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())


def _files_of_keys(path: Path) -> Dict[str, str]:
    """Which shard file each DCP key's bytes live in (DCP's own metadata)."""
    metadata = FileSystemReader(path).read_metadata()
    return {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}


def _writer_rank(file_name: str) -> int:
    return int(file_name.split("_")[2])  # DCP names a rank's file __<rank>_<n>.distcp


def _stage_of(dcp_key: str) -> int:
    # state_dict.<layer>.<...> or optimizer_states.<i>.<layer>.<...>
    parts = dcp_key.split(".")
    layer = int(parts[1] if parts[0] == "state_dict" else parts[2])
    return next(s for s, layers in enumerate(STAGES) if layer in layers)


# -- multi-process: what each rank writes --------------------------------------------------------


@pytest.mark.slow
def test_each_rank_writes_only_its_own_stage_tensors(two_ranks):
    files = _files_of_keys(two_ranks / "ckpt")
    assert files, "no keys in the checkpoint"
    assert {key: _writer_rank(f) for key, f in files.items()} == {key: _stage_of(key) for key in files}


@pytest.mark.slow
def test_no_rank_materialises_the_other_stage(two_ranks):
    assert [_seen(two_ranks, r)["other_stage_on_meta"] for r in range(2)] == [True, True]


@pytest.mark.slow
def test_replicas_write_each_tensor_once_in_files_of_ranks_holding_it(four_ranks):
    path = four_ranks / "ckpt"
    files = _files_of_keys(path)
    holders = {key: {r for r in range(4) if r % 2 == _stage_of(key)} for key in files}
    assert all(_writer_rank(f) in holders[key] for key, f in files.items())
    # each key has one location, and the shard files hold nothing else: no second copy anywhere
    metadata = FileSystemReader(path).read_metadata()
    stored = sum(info.length for info in metadata.storage_data.values())
    on_disk = sum(f.stat().st_size for f in path.glob("*.distcp"))
    assert on_disk == stored


@pytest.mark.slow
def test_replicated_checkpoint_loads_equal_to_the_unsharded_model(four_ranks):
    model, optimizer = _reference(3)
    loaded = sharded.load(four_ranks / "ckpt")
    assert _equal(loaded["state_dict"], model.state_dict())
    assert _equal(loaded["optimizer_states"][0], _adam_by_name(optimizer, model))


# -- multi-process: reading it back --------------------------------------------------------------


@pytest.mark.slow
def test_load_without_a_group_returns_the_whole_state_equal_to_the_unsharded_model(two_ranks):
    model, optimizer = _reference(3)
    loaded = sharded.load(two_ranks / "ckpt")
    assert _equal(loaded["state_dict"], model.state_dict())
    assert _equal(loaded["optimizer_states"][0], _adam_by_name(optimizer, model))


@pytest.mark.slow
def test_entries_other_than_tensors_come_from_rank_zero(two_ranks):
    loaded = sharded.load(two_ranks / "ckpt")
    assert (loaded["epoch"], loaded["global_step"]) == (20, 7)  # rank 1 passed epoch 21
    assert loaded["loops"] == {"fit_loop": {"nested": [1, 2]}}


@pytest.mark.slow
def test_a_rank_alone_in_a_group_loads_just_its_keys(two_ranks):
    model, optimizer = _reference(3)
    keys = _seen(two_ranks, 1)["own_keys"]
    loaded = torch.load(two_ranks / "loaded1.pt", weights_only=False)
    assert _equal(loaded["state_dict"], {k: v for k, v in model.state_dict().items() if k in keys})
    full = _adam_by_name(optimizer, model)
    mine = {n: s for n, s in full["state"].items() if n in keys}
    assert _equal(loaded["optimizer_states"][0]["state"], mine)
    assert loaded["optimizer_states"][0]["param_groups"] == full["param_groups"]


@pytest.mark.slow
def test_loading_some_keys_reads_no_other_shard_file(two_ranks, tmp_path):
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in (two_ranks / "ckpt").iterdir():
        if f.name != "__1_0.distcp":  # stage 1's shard is gone
            (copy / f.name).write_bytes(f.read_bytes())
    keys = _seen(two_ranks, 0)["own_keys"]
    model, _ = _reference(3)
    loaded = sharded.load(copy, keys=keys)
    assert _equal(loaded["state_dict"], {k: v for k, v in model.state_dict().items() if k in keys})
    with pytest.raises(PipeckptCheckpointError, match=r"shard file '__1_0.distcp' is missing"):
        sharded.load(copy)


@pytest.mark.slow
def test_converted_checkpoint_loads_strictly_and_training_continues_equal(two_ranks, tmp_path):
    out = tmp_path / "plain.ckpt"
    sharded.to_torch_save(two_ranks / "ckpt", out)
    plain = torch.load(out, weights_only=False)
    reference, reference_optimizer = _reference(3)
    assert _equal(plain["optimizer_states"][0], reference_optimizer.state_dict())  # Lightning's layout
    model, optimizer = build()
    model.load_state_dict(plain["state_dict"], strict=True)
    optimizer.load_state_dict(plain["optimizer_states"][0])
    train(model, optimizer, 2, (0, 1, 2, 3), first=3)
    train(reference, reference_optimizer, 2, (0, 1, 2, 3), first=3)
    assert _equal(model.state_dict(), reference.state_dict())


# -- multi-process: atomicity --------------------------------------------------------------------


@pytest.mark.slow
def test_a_replacing_save_leaves_the_new_checkpoint_and_nothing_beside_it(two_ranks):
    assert [_seen(two_ranks, r)["after_replacing"] for r in range(2)] == [{"epoch": 20, "beside": []}] * 2


@pytest.mark.slow
def test_a_failure_while_writing_raises_on_every_rank_and_keeps_the_older_checkpoint(two_ranks):
    failures = [_seen(two_ranks, r)["failed_save"] for r in range(2)]
    assert all(f is not None and "injected failure while writing" in f for f in failures), failures
    model, _ = _reference(3)
    loaded = sharded.load(two_ranks / "ckpt")
    assert loaded["epoch"] == 20
    assert _equal(loaded["state_dict"], model.state_dict())
    assert [p.name for p in two_ranks.iterdir() if p.name.startswith(".")] == []  # no temporary left


@pytest.mark.slow
def test_a_kill_at_any_moment_leaves_a_whole_checkpoint_at_the_path(tmp_path):
    rng = random.Random(8)  # kill moments reproduce
    for trial in range(6):
        out = tmp_path / str(trial)
        out.mkdir()
        log = tmp_path / f"{trial}.log"
        proc = ranks.spawn(WORKER, ["overwrite", str(out)], _env(), 0, REPO, log)
        try:
            deadline = time.time() + DEADLINE_S
            while "saved 0\n" not in log.read_text():  # one save done: now kill it in the next ones
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.6))
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            ranks.stop([proc])
        done = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("saved ")]
        loaded = sharded.load(out / "ckpt")
        number = loaded["epoch"]
        assert number >= (done[-1] if done else 0)
        assert torch.equal(loaded["state_dict"]["w"], torch.full((2**21,), float(number)))
        sharded.save(loaded, out / "ckpt")  # the next save clears what the killed one left
        assert os.listdir(out) == ["ckpt"]
