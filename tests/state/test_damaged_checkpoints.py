"""A damaged or foreign checkpoint gets pipeckpt's own message before any training step: random
bytes, a truncated file, a sharded directory missing a piece (named), another model's keys or
shapes (the first differences under the module's keys, and the hyper-parameters to fix)."""

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from pipeckpt import PipeckptCheckpointError, PipelineStrategy
from pipeckpt.app.data import SyntheticVectors
from pipeckpt.app.models import MLP
from pipeckpt.engines.base import optimizer_param_names
from pipeckpt.state import sharded

MODEL = dict(in_features=8, hidden=16, depth=2, num_classes=4)


class Steps(L.Callback):
    """Counts the training steps that ran."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1


def trainer(tmp: Path, steps: int = 4, *callbacks: L.Callback) -> L.Trainer:
    return L.Trainer(
        strategy=PipelineStrategy(stages=2, chunks=2),
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
        callbacks=list(callbacks),
    )


def data() -> SyntheticVectors:
    return SyntheticVectors(in_features=8, num_classes=4, num_samples=64, val_samples=32, batch_size=8)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A real single-file checkpoint after 2 steps."""
    out = tmp_path_factory.mktemp("plain")
    run = trainer(out, steps=2)
    run.fit(MLP(**MODEL), data())
    run.save_checkpoint(out / "plain.ckpt")
    return out / "plain.ckpt"


@pytest.fixture
def sharded_dir(plain, tmp_path) -> Path:
    checkpoint = torch.load(plain, weights_only=True)
    module = MLP(**MODEL)
    names = optimizer_param_names(module, module.configure_optimizers())
    state = sharded.optimizer_state_by_name(checkpoint["optimizer_states"][0], names)
    checkpoint["optimizer_states"] = [state]
    sharded.save(checkpoint, tmp_path / "sharded")
    return tmp_path / "sharded"


def resume(tmp: Path, ckpt: Path, **model: Any) -> str:
    """The message of the error resuming ``ckpt`` raises; no step may have run."""
    steps = Steps()
    with pytest.raises(PipeckptCheckpointError) as raised:
        trainer(tmp, 4, steps).fit(MLP(**dict(MODEL, **model)), data(), ckpt_path=ckpt)
    assert steps.count == 0
    return str(raised.value)


def test_random_bytes_are_not_a_checkpoint(tmp_path):
    ckpt = tmp_path / "random.ckpt"
    ckpt.write_bytes(b"\x13" + os.urandom(4095))  # neither a zip nor a pickle header
    message = resume(tmp_path, ckpt)
    assert f"{str(ckpt)!r}: is not a checkpoint" in message and "HINT" in message
    assert "weights_only" not in message  # none of torch's advice to load it unsafely


def test_a_truncated_file_is_named_truncated(plain, tmp_path):
    ckpt = tmp_path / "cut.ckpt"
    ckpt.write_bytes(plain.read_bytes()[: plain.stat().st_size // 2])
    message = resume(tmp_path, ckpt)
    assert f"{str(ckpt)!r}: is truncated or damaged" in message and "HINT" in message


def test_an_empty_file_is_named_empty(tmp_path):
    ckpt = tmp_path / "empty.ckpt"
    ckpt.write_bytes(b"")
    assert f"{str(ckpt)!r}: is empty" in resume(tmp_path, ckpt)


@pytest.mark.parametrize("piece", [sharded.META_FILE, ".metadata"])
def test_a_sharded_directory_without_a_piece_names_it(sharded_dir, tmp_path, piece):
    (sharded_dir / piece).unlink()
    message = resume(tmp_path, sharded_dir)
    assert f"sharded checkpoint directory {str(sharded_dir)!r}: has no {piece} (" in message
    assert "Is a directory" not in message


def test_a_sharded_directory_without_a_shard_names_it(sharded_dir, tmp_path):
    (shard,) = sharded_dir.glob("*.distcp")
    shard.unlink()
    message = resume(tmp_path, sharded_dir)
    assert f"its shard file {shard.name!r} is missing" in message


def test_a_cut_shard_is_named(sharded_dir, tmp_path):
    (shard,) = sharded_dir.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    assert f"its shard file {shard.name!r} holds 100 bytes of the" in resume(tmp_path, sharded_dir)


def test_another_models_shapes_are_named_with_the_hyper_parameter_to_fix(plain, tmp_path):
    message = resume(tmp_path, plain, hidden=32)
    assert "does not fit this MLP" in message
    assert "is (16, 8) in the checkpoint, (32, 8) in the model" in message
    assert "HINT: build the MLP the checkpoint was written with: hidden=16 (this model: 32)" in message


def test_another_models_keys_are_named(plain, tmp_path):
    message = resume(tmp_path, plain, depth=3)
    assert "is not in the checkpoint" in message and "depth=2 (this model: 3)" in message


def test_another_models_keys_are_named_in_a_sharded_checkpoint(sharded_dir, tmp_path):
    message = resume(tmp_path, sharded_dir, hidden=32)
    assert "in the checkpoint, (32, 8) in the model" in message and "hidden=16 (this model: 32)" in message
