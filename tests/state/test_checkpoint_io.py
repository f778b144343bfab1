"""Atomic checkpoint writes (pipeckpt/state/files.py): a checkpoint file or directory appears
only complete, durably, without a second in-memory copy. The kill -9 trials of a real training
run are in test_kill_trials.py."""

import os
import stat
import tracemalloc
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Tuple

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from support.toy import ToyModule, fit

from pipeckpt import PipelineStrategy
from pipeckpt._errors import PipeckptConfigError
from pipeckpt.state.files import (
    AtomicCheckpointIO,
    atomic_replace_dir,
    atomic_write,
    hidden_sibling_prefix,
    temporary_dir_beside,
)


def checkpoint(value: float) -> Dict[str, Any]:
    return {"w": torch.full((256,), value), "step": int(value)}


def entries(directory: Path) -> List[str]:
    return sorted(os.listdir(directory))


class Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("cannot pickle this")


# -- files ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["str", "Path", "file-url"])
def test_a_saved_checkpoint_loads_back_for_each_kind_of_path(tmp_path, kind):
    target = tmp_path / "sub" / "a.ckpt"  # the missing parent is created
    path = {"str": str(target), "Path": target, "file-url": f"file://{target}"}[kind]
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint(3.0), path)
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["w"], torch.full((256,), 3.0)) and loaded["step"] == 3
    assert entries(tmp_path / "sub") == ["a.ckpt"]


def _fail_in_torch_save(io: AtomicCheckpointIO, path: Path, monkeypatch: Any) -> None:
    io.save_checkpoint({"w": torch.ones(3), "bad": Unpicklable()}, path)


def _fail_after_the_bytes_in_fsync(io: AtomicCheckpointIO, path: Path, monkeypatch: Any) -> None:
    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    io.save_checkpoint(checkpoint(2.0), path)


def _fail_in_the_rename(io: AtomicCheckpointIO, path: Path, monkeypatch: Any) -> None:
    def refuse(src: Any, dst: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    io.save_checkpoint(checkpoint(2.0), path)


@pytest.mark.parametrize(
    "fail",
    [_fail_in_torch_save, _fail_after_the_bytes_in_fsync, _fail_in_the_rename],
    ids=lambda f: f.__name__,
)
def test_a_failed_save_leaves_the_old_checkpoint_intact_and_no_temporary_file(tmp_path, monkeypatch, fail):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint(1.0), path)
    with pytest.raises((RuntimeError, OSError)):
        fail(io, path, monkeypatch)
    monkeypatch.undo()
    assert entries(tmp_path) == ["last.ckpt"]
    assert torch.equal(torch.load(path)["w"], torch.full((256,), 1.0))


def test_a_write_that_fails_halfway_leaves_no_partial_file(tmp_path):
    path = tmp_path / "shard.bin"

    def half_then_fail(file: BinaryIO) -> None:
        file.write(b"x" * 1000)
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        atomic_write(path, half_then_fail)
    assert entries(tmp_path) == []


def test_the_temporary_file_is_a_hidden_sibling_of_the_target_not_in_tmpdir(tmp_path, monkeypatch):
    elsewhere = tmp_path / "node-local-tmp"
    elsewhere.mkdir()
    monkeypatch.setenv("TMPDIR", str(elsewhere))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    renames: List[Tuple[str, str]] = []
    real_replace = os.replace

    def record(src: Any, dst: Any) -> None:
        renames.append((os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", record)
    out = tmp_path / "out"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), out / "last.ckpt")
    [(src, dst)] = renames
    assert dst == str(out / "last.ckpt")
    assert os.path.dirname(src) == str(out)
    assert os.path.basename(src).startswith(hidden_sibling_prefix("last.ckpt")) and src.endswith(".tmp")
    assert "ckpt_" not in os.path.basename(src)  # Lightning reads digits from names with 'ckpt_'
    assert entries(elsewhere) == []


def test_the_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events: List[Tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("replace", os.fspath(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), tmp_path / "a.ckpt")
    tmp = events[1][1]
    assert events == [("fsync", tmp), ("replace", tmp), ("fsync", str(tmp_path))]


def test_the_file_gets_the_permissions_of_a_plain_open(tmp_path):
    umask = os.umask(0o022)
    try:
        AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), tmp_path / "a.ckpt")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "a.ckpt").st_mode) == 0o644  # not mkstemp's 0600


def test_saving_holds_no_serialised_copy_of_the_checkpoint_in_memory(tmp_path, monkeypatch):
    """Python-side allocations (a BytesIO and its getvalue() copy are) while saving 4 MiB of
    tensors: below 1/8 of that, where Lightning's own TorchCheckpointIO takes more than all of it."""
    big = {"w": torch.randn(1 << 20)}
    size = big["w"].nbytes

    def peak_while_saving(io: Any, path: Path) -> int:
        tracemalloc.start()
        try:
            io.save_checkpoint(big, path)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert peak_while_saving(TorchCheckpointIO(), tmp_path / "lightning.ckpt") > size  # the measure sees it

    def no_lightning_save(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Lightning's BytesIO-based _atomic_save was used")

    monkeypatch.setattr("lightning.fabric.utilities.cloud_io._atomic_save", no_lightning_save)
    monkeypatch.setattr("lightning.fabric.plugins.io.torch_io._atomic_save", no_lightning_save)
    assert peak_while_saving(AtomicCheckpointIO(), tmp_path / "atomic.ckpt") < size // 8
    assert torch.equal(torch.load(tmp_path / "atomic.ckpt")["w"], big["w"])


def test_a_non_local_url_is_saved_the_way_lightning_saves_it():
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint(5.0), "memory://pipeckpt-test/a.ckpt")
    assert torch.equal(io.load_checkpoint("memory://pipeckpt-test/a.ckpt")["w"], torch.full((256,), 5.0))
    io.remove_checkpoint("memory://pipeckpt-test/a.ckpt")
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint("memory://pipeckpt-test/a.ckpt")


def test_storage_options_are_refused_as_lightning_refuses_them(tmp_path):
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), tmp_path / "a.ckpt", storage_options={"x": 1})


def test_remove_checkpoint_removes_a_file_and_a_directory(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint(1.0), tmp_path / "a.ckpt")
    (tmp_path / "sharded.ckpt").mkdir()
    (tmp_path / "sharded.ckpt" / "rank0.pt").write_bytes(b"x")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "sharded.ckpt")
    assert entries(tmp_path) == []


def test_the_pipe_strategy_saves_through_the_plugin(tmp_path, monkeypatch):
    written: List[str] = []
    real_replace = os.replace

    def record(src: Any, dst: Any) -> None:
        written.append(os.fspath(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", record)
    trainer = fit(ToyModule(), PipelineStrategy(stages=2), steps=1, plugins=[AtomicCheckpointIO()])
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert written == [str(tmp_path / "a.ckpt")]
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["global_step"] == 1


# -- directories ----------------------------------------------------------------------


def write_dir(path: str, content: str) -> None:
    for rank in range(2):
        Path(path, f"rank{rank}.pt").write_text(f"{content}{rank}")


def test_a_directory_written_aside_takes_the_targets_name(tmp_path):
    target = tmp_path / "step=4.ckpt"
    tmp = temporary_dir_beside(target)
    assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith(
        hidden_sibling_prefix("step=4.ckpt")
    )
    write_dir(tmp, "new")
    atomic_replace_dir(tmp, target)
    assert entries(tmp_path) == ["step=4.ckpt"]
    assert (target / "rank1.pt").read_text() == "new1"


def test_replacing_a_directory_removes_the_old_one_only_after_the_rename(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    write_dir(str(target), "old")
    tmp = temporary_dir_beside(target)
    write_dir(tmp, "new")
    events: List[Tuple[str, ...]] = []
    real_rename, real_fsync = os.rename, os.fsync

    def rename(src: Any, dst: Any) -> None:
        events.append(("rename", os.path.basename(src), os.path.basename(dst)))
        real_rename(src, dst)

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path):
            events.append(("fsync parent",))
        real_fsync(fd)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr("shutil.rmtree", lambda p, **kw: events.append(("rmtree", os.path.basename(p))))
    atomic_replace_dir(tmp, target)
    aside = events[0][2]
    assert events == [
        ("rename", "last.ckpt", aside),
        ("rename", os.path.basename(tmp), "last.ckpt"),
        ("fsync parent",),
        ("rmtree", aside),
    ]
    assert (
        aside.startswith(hidden_sibling_prefix("last.ckpt") + "old-")
        and (target / "rank0.pt").read_text() == "new0"
    )


def test_replacing_a_directory_leaves_no_old_copy_behind(tmp_path):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    write_dir(str(target), "old")
    tmp = temporary_dir_beside(target)
    write_dir(tmp, "new")
    atomic_replace_dir(tmp, target)
    assert entries(tmp_path) == ["last.ckpt"] and entries(target) == ["rank0.pt", "rank1.pt"]
    assert (target / "rank0.pt").read_text() == "new0"


def test_a_failed_directory_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    write_dir(str(target), "old")
    tmp = temporary_dir_beside(target)
    write_dir(tmp, "new")
    real_rename = os.rename

    def fail_on_the_new_one(src: Any, dst: Any) -> None:
        if os.fspath(src) == tmp:
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", fail_on_the_new_one)
    with pytest.raises(OSError, match="Input/output"):
        atomic_replace_dir(tmp, target)
    assert (target / "rank0.pt").read_text() == "old0"
    assert entries(tmp_path) == sorted(["last.ckpt", os.path.basename(tmp)])


def test_a_directory_replace_fsyncs_every_file_it_moves(tmp_path, monkeypatch):
    tmp = temporary_dir_beside(tmp_path / "d.ckpt")
    write_dir(tmp, "new")
    synced: List[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_replace_dir(tmp, tmp_path / "d.ckpt")
    assert {os.path.join(tmp, "rank0.pt"), os.path.join(tmp, "rank1.pt"), tmp} <= set(synced)


def test_replacing_with_something_that_is_not_a_directory_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(PipeckptConfigError, match=r"tmp_dir='.*file'.*HINT: write the checkpoint into"):
        atomic_replace_dir(tmp_path / "file", tmp_path / "d.ckpt")


def test_replacing_from_another_filesystem_is_a_config_error(tmp_path):
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp_path")
    tmp = Path(temporary_dir_beside(other / f"pipeckpt-test-{os.getpid()}"))
    try:
        with pytest.raises(
            PipeckptConfigError, match=r"another filesystem.*HINT: create it with temporary_dir"
        ):
            atomic_replace_dir(tmp, tmp_path / "d.ckpt")
    finally:
        tmp.rmdir()
    assert entries(tmp_path) == []


def test_the_pipe_strategy_saves_atomically_unless_told_otherwise():
    assert isinstance(
        fit(ToyModule(), PipelineStrategy(), steps=1).strategy.checkpoint_io, AtomicCheckpointIO
    )
    chosen = TorchCheckpointIO()
    assert fit(ToyModule(), PipelineStrategy(), steps=1, plugins=[chosen]).strategy.checkpoint_io is chosen


def test_a_leftover_from_a_killed_hpc_save_does_not_change_which_checkpoint_lightning_resumes(tmp_path):
    # Lightning resumes from hpc_ckpt_<the highest number among the names containing 'hpc_ckpt_'>.
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    atomic_write(tmp_path / "hpc_ckpt_1.ckpt", lambda f: f.write(b"whole"))
    leftover = temporary_dir_beside(tmp_path / "hpc_ckpt_2.ckpt")  # a save killed mid-write
    assert os.path.isdir(leftover)
    found = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(tmp_path, "hpc_ckpt_")
    assert found == 1
