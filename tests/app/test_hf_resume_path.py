"""``model=hf`` resumed (``ckpt_path=...``) with another ``model.path`` than its checkpoint's is refused
before any work, in the app's names (issue 45): the checkpoint's recorded directory is read from its
hyper-parameters alone, weights-only, and compared with ``model.path`` in ``check_config``, before the
new directory, the data or the model is read (pipeckpt/app/models/hf_resume.py)."""

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Tuple

import pytest
import torch
from test_app_checks import compose_train, refusal
from test_hf_pretrained_dirs import run

from pipeckpt._errors import PipeckptCheckpointError
from pipeckpt.app.checks import check_config
from pipeckpt.app.tiny_pretrained import make_tiny_pretrained
from pipeckpt.state import sharded

CALLED = f"{os.system.__module__}.system"  # what the payload calls: posix.system on Linux


class Payload:
    """Unpickling this runs ``touch <marker>`` (as tests/state/test_safe_load.py plants it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Tuple[Callable[..., Any], Tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny) -> Path:
    """last.ckpt of one step of ``model=hf`` fine-tuning ``tiny``."""
    out = tmp_path_factory.mktemp("run")
    done = run(out, "model=hf", f"model.path={tiny}", "validate=false")
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "checkpoints" / "last.ckpt"


@pytest.fixture
def other(tmp_path, tiny) -> Path:
    """Another directory of the same model, whose config.json no reader could parse: a refusal of
    the resume that read it first would name config.json instead."""
    path = Path(shutil.copytree(tiny, tmp_path / "other"))
    (path / "config.json").write_text("{not json")
    return path


def test_another_model_path_is_refused_naming_both_paths_before_the_directory_is_read(
    tmp_path, trained, tiny, other
):
    message = refusal(tmp_path, "model=hf", f"model.path={other}", f"ckpt_path={trained}")
    assert message.startswith(
        f"model.path={other} with ckpt_path={trained}, written by a run of model.path={tiny}: "
    )
    assert f"HINT: set model.path={tiny} to resume that run, or start without ckpt_path" in message
    assert "pretrained_path" not in message


def test_the_checkpoints_own_directory_by_another_spelling_resumes(tmp_path, trained, tiny):
    link = tmp_path / "link"
    link.symlink_to(tiny, target_is_directory=True)
    check_config(compose_train(tmp_path, "model=hf", f"model.path={link}", f"ckpt_path={trained}"))


def test_a_checkpoint_trained_from_a_config_is_refused_with_a_model_path(tmp_path, tiny):
    ckpt = tmp_path / "scratch.ckpt"
    torch.save({"hyper_parameters": {"pretrained_path": None, "config": None}, "state_dict": {}}, ckpt)
    message = refusal(tmp_path, "model=hf", f"model.path={tiny}", f"ckpt_path={ckpt}")
    assert message.startswith(f"model.path={tiny} with ckpt_path={ckpt}, written by a run of model.path=null")


def test_a_sharded_checkpoints_directory_is_read_from_rank_zeros_part_alone(tmp_path, tiny, other):
    ckpt = tmp_path / "sharded"
    hparams = {"pretrained_path": str(tiny)}
    sharded.save({"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": hparams}, ckpt)
    for shard in ckpt.glob("*.distcp"):
        shard.unlink()
    message = refusal(tmp_path, "model=hf", f"model.path={other}", f"ckpt_path={ckpt}")
    assert f"written by a run of model.path={tiny}: " in message


def test_a_checkpoint_whose_hyper_parameters_would_run_code_is_refused_running_none(tmp_path, tiny):
    marker = tmp_path / "ran"
    ckpt = tmp_path / "planted.ckpt"
    torch.save({"hyper_parameters": {"pretrained_path": str(tiny), "x": Payload(marker)}}, ckpt)
    with pytest.raises(PipeckptCheckpointError) as error:
        check_config(compose_train(tmp_path, "model=hf", f"model.path={tiny}", f"ckpt_path={ckpt}"))
    assert str(error.value).startswith(f"checkpoint file {str(ckpt)!r} holds {CALLED}")
    assert not marker.exists()


def test_lightnings_named_checkpoints_are_left_to_the_resume(tmp_path, tiny):
    check_config(compose_train(tmp_path, "model=hf", f"model.path={tiny}", "ckpt_path=last"))
