"""Where an export writes: a read-only or full filesystem is named with the target and the fix (not a
raw OSError) and leaves nothing beside the target, not even the hidden partial directory; ``HFExport``
refuses a wrong prefix or target when ``fit`` starts, before the first step; a checkpoint that
records no model needs the prefix and config named."""

import errno
import os
from pathlib import Path
from typing import List

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
from support.full_disk import fill
from support.hf_models import HFModule, batches, whole

import pipeckpt
from pipeckpt._errors import PipeckptConfigError, PipeckptSaveError
from pipeckpt.export import HFExport, export_hf
from pipeckpt.export.__main__ import main as cli

pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(module, callbacks=()) -> object:
    from support.trainers import quiet_trainer

    strategy = pipeckpt.PipelineStrategy(stages=2, chunks=2)
    trainer = quiet_trainer(strategy, max_steps=1, callbacks=list(callbacks))
    trainer.fit(module, DataLoader(batches(1), batch_size=None))
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple:
    """(a tiny Llama's module, the checkpoint of one step of it)."""
    torch.set_num_threads(1)
    module = HFModule("llama", whole)
    path = tmp_path_factory.mktemp("run") / "run.ckpt"
    _fit(module).save_checkpoint(path)  # type: ignore[attr-defined]
    return module, path


def _export(trained, out: Path) -> Path:
    module, ckpt = trained
    return export_hf(ckpt, out, prefix="model.", config=module.model.config, model_class=type(module.model))


def _read_only(monkeypatch, directory: Path) -> None:
    """Makes ``directory`` refuse new entries as a read-only filesystem does (root ignores modes)."""
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        if Path(path).parent == directory:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)


def test_a_read_only_target_is_named_with_the_fix_and_nothing_is_left(trained, tmp_path, monkeypatch):
    _read_only(monkeypatch, tmp_path)
    with pytest.raises(PipeckptSaveError) as error:
        _export(trained, tmp_path / "hf")
    assert error.value.errno == errno.EROFS
    assert str(error.value).startswith(f"out={str(tmp_path / 'hf')!r}: read-only file system")
    assert "HINT: mount that filesystem writable or pass another out" in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_mid_export_is_named_and_its_partial_directory_removed(trained, tmp_path):
    empty = fill(tmp_path)
    try:
        with pytest.raises(PipeckptSaveError) as error:
            _export(trained, tmp_path / "hf")
    finally:
        empty()
    assert error.value.errno == errno.ENOSPC
    assert "no space left on device" in str(error.value) and "nothing partial is left" in str(error.value)
    assert list(tmp_path.iterdir()) == []  # no hidden .pipeckpt-* directory


def test_the_cli_names_a_full_disk_in_one_line_and_exits_1(trained, tmp_path, capsys):
    module, ckpt = trained
    module.model.config.save_pretrained(tmp_path / "cfg")
    (tmp_path / "exports").mkdir()
    empty = fill(tmp_path / "exports")
    try:
        with pytest.raises(SystemExit) as exit:
            cli([str(ckpt), str(tmp_path / "exports" / "hf"), "--prefix", "model.", "--config",
                 str(tmp_path / "cfg"), "--model-class", "LlamaForCausalLM"])  # fmt: skip
    finally:
        empty()
    err = capsys.readouterr().err
    assert exit.value.code == 1 and err.count("\n") == 1 and "no space left on device" in err
    assert list((tmp_path / "exports").iterdir()) == []


def test_a_checkpoint_that_records_no_model_needs_prefix_and_config_named(trained, tmp_path):
    _, ckpt = trained
    with pytest.raises(
        PipeckptConfigError, match=r"only a run of the app's model=hf records them.*HINT: pass prefix="
    ):
        export_hf(ckpt, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def _counted() -> tuple:
    """A tiny Llama module and the list its training steps append to."""
    steps: List[int] = []
    module = HFModule("llama", lambda model, batch: steps.append(1) or whole(model, batch))
    return module, steps


def test_hfexport_refuses_a_wrong_prefix_before_the_first_step(tmp_path):
    module, steps = _counted()
    with pytest.raises(PipeckptConfigError, match=r"HFExport\(prefix='net\.'\).*has no submodule 'net'"):
        _fit(module, [HFExport(tmp_path / "hf", prefix="net.")])
    assert steps == []


def test_hfexport_refuses_a_target_holding_other_files_before_the_first_step(tmp_path):
    module, steps = _counted()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(PipeckptConfigError, match=r"HFExport dirpath=.*\['notes.txt'\].*no export wrote"):
        _fit(module, [HFExport(tmp_path / "hf")])
    assert steps == [] and [p.name for p in (tmp_path / "hf").iterdir()] == ["notes.txt"]


def test_hfexport_refuses_a_read_only_target_before_the_first_step(tmp_path, monkeypatch):
    module, steps = _counted()
    _read_only(monkeypatch, tmp_path)
    with pytest.raises(PipeckptSaveError, match=r"HFExport dirpath=.*read-only file system"):
        _fit(module, [HFExport(tmp_path / "hf")])
    assert steps == [] and list(tmp_path.iterdir()) == []
