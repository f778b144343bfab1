"""Sharded checkpoints (pipeckpt/state/sharded.py): each rank writes its own stages' tensors, a
replicated tensor is written once, load reads only what is asked, the converter gives the plain
Lightning checkpoint, and a checkpoint at its path is never a half-written one.

Multi-process tests start real gloo processes (tests/state/sharded_worker.py) and kill them at the end.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch
from sharded_worker import STAGES, build, names, train
from support import ranks
from support.paths import REPO, launcher_free, worker_pythonpath
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from pipeckpt._errors import PipeckptCheckpointError, PipeckptConfigError
from pipeckpt.state import directories, sharded

HERE = Path(__file__).resolve().parent
WORKER = HERE / "sharded_worker.py"
DEADLINE_S = 240  # 4 processes starting torch on 2 shared cores


def _reference(steps: int) -> tuple:
    """The whole model trained in this process, on one thread like the workers (BatchNorm's
    reductions round differently on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, optimizer = build()
        train(model, optimizer, steps, (0, 1, 2, 3))
    finally:
        torch.set_num_threads(threads)
    return model, optimizer


def _equal(a: Any, b: Any) -> bool:
    """Exactly equal nests of dicts, lists and tuples of tensors (same dtype) and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _adam_by_name(optimizer: torch.optim.Optimizer, model: nn.Module) -> Dict[str, Any]:
    return sharded.optimizer_state_by_name(optimizer.state_dict(), names(model))


# -- processes -----------------------------------------------------------------------------------


def _env(**extra: str) -> Dict[str, str]:
    env = launcher_free(os.environ)
    env.update(PYTHONPATH=worker_pythonpath(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


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


# -- one process ---------------------------------------------------------------------------------


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
