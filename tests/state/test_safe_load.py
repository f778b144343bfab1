"""Loading a checkpoint never runs code from it: a ``__reduce__`` payload that would create a marker
file is planted in each file of a sharded checkpoint and in a single-file checkpoint, and the
checkpoint is resumed through ``python train.py ckpt_path=...``, ``Trainer.fit(ckpt_path=...)`` and
``python -m pipeckpt.convert``. Nothing runs, and every path fails naming the file and the class."""

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import lightning as L
import pytest
import torch
from support import forkserver

from pipeckpt import PipeckptCheckpointError, PipelineStrategy
from pipeckpt.app.data import SyntheticVectors
from pipeckpt.app.models import MLP
from pipeckpt.engines.base import optimizer_param_names
from pipeckpt.state import sharded

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(in_features=8, hidden=16, depth=2, num_classes=4)
FAST = ["trainer=fast", "trainer.enable_progress_bar=false", "threads=1", "model=mlp", "validate=false"]
FAST += [f"model.{k}={v}" for k, v in MODEL.items()] + ["data.num_samples=64", "data.val_samples=32"]
CALLED = f"{os.system.__module__}.system"  # what the payload calls: posix.system on Linux


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Tuple[Callable[..., Any], Tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def run_train(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "train.py", *FAST, f"hydra.run.dir={out}", *overrides]
    return forkserver.run(command, cwd=ROOT, env=env, timeout=300)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A real single-file checkpoint of a 2-step train.py run."""
    out = tmp_path_factory.mktemp("plain")
    done = run_train(out, "trainer.max_steps=2")
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "checkpoints" / "last.ckpt"


def as_sharded(plain: Path, out: Path, extra_state: Dict[str, Any] | None = None) -> Path:
    """``plain`` rewritten as a sharded directory (optimizer state keyed by name), with ``extra_state``
    added to the first parameter's optimizer state (DCP writes a non-tensor as a byte item)."""
    checkpoint = torch.load(plain, weights_only=True)
    module = MLP(**MODEL)
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    names = optimizer_param_names(module, optimizer)
    state = sharded.optimizer_state_by_name(checkpoint["optimizer_states"][0], names)
    if extra_state:
        state["state"][names[0]].update(extra_state)
    checkpoint["optimizer_states"] = [state]
    sharded.save(checkpoint, out)
    return out


def plant(where: str, plain: Path, tmp: Path, marker: Path) -> Tuple[Path, Path]:
    """A checkpoint with the payload in ``where``; returns it and the file holding the payload."""
    if where == "single":
        checkpoint = torch.load(plain, weights_only=True)
        checkpoint["hyper_parameters"]["note"] = Payload(marker)
        torch.save(checkpoint, tmp / "evil.ckpt")
        return tmp / "evil.ckpt", tmp / "evil.ckpt"
    if where == "shard":
        root = as_sharded(plain, tmp / "evil", {"note": Payload(marker)})
        (shard,) = root.glob("*.distcp")
        return root, shard
    root = as_sharded(plain, tmp / "evil")
    if where == "metadata":
        (root / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        return root, root / ".metadata"
    meta = torch.load(root / sharded.META_FILE, weights_only=True)
    meta["note"] = Payload(marker)
    torch.save(meta, root / sharded.META_FILE)
    return root, root / sharded.META_FILE


WHERE = ["metadata", "meta_file", "shard", "single"]


def refused(text: str, file: Path) -> bool:
    return f"{str(file)!r} holds {CALLED}" in text and "nothing in it was run" in text


@pytest.mark.parametrize("where", WHERE)
def test_train_py_resume_runs_nothing_and_names_the_file_and_class(plain, tmp_path, where):
    marker = tmp_path / "ran"
    ckpt, holder = plant(where, plain, tmp_path, marker)
    done = run_train(tmp_path / "run", f"ckpt_path={ckpt}", "trainer.max_steps=4")
    assert not marker.exists(), "the payload ran"
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert refused(done.stderr, holder), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("where", WHERE)
def test_trainer_fit_resume_runs_nothing_and_names_the_file_and_class(plain, tmp_path, where):
    marker = tmp_path / "ran"
    ckpt, holder = plant(where, plain, tmp_path, marker)
    trainer = L.Trainer(
        strategy=PipelineStrategy(stages=2, chunks=2),
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    data = SyntheticVectors(in_features=8, num_classes=4, num_samples=64, val_samples=32, batch_size=8)
    with pytest.raises(PipeckptCheckpointError) as raised:
        trainer.fit(MLP(**MODEL), data, ckpt_path=ckpt, weights_only=True)
    assert not marker.exists(), "the payload ran"
    assert refused(str(raised.value), holder), str(raised.value)


@pytest.mark.parametrize("where", ["metadata", "meta_file", "shard"])
def test_convert_runs_nothing_and_names_the_file_and_class(plain, tmp_path, where):
    marker = tmp_path / "ran"
    ckpt, holder = plant(where, plain, tmp_path, marker)
    done = forkserver.run(
        [sys.executable, "-m", "pipeckpt.convert", str(ckpt), str(tmp_path / "out.ckpt")],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert not marker.exists(), "the payload ran"
    assert done.returncode == 2, done.stderr[-3000:]
    assert refused(done.stderr, holder), done.stderr[-3000:]
    assert not (tmp_path / "out.ckpt").exists()


def test_a_clean_sharded_checkpoint_still_loads_and_converts(plain, tmp_path):
    root = as_sharded(plain, tmp_path / "clean", {"count": 3})  # a byte item of plain data
    loaded = sharded.load(root)
    assert loaded["global_step"] == 2 and loaded["optimizer_states"][0]["state"]
    sharded.to_torch_save(root, tmp_path / "out.ckpt")
    assert torch.load(tmp_path / "out.ckpt", weights_only=True)["global_step"] == 2
