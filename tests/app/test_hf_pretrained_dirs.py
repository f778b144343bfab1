"""``model=hf`` on pretrained directories as people have them (pipeckpt/app/models/hf_directory.py):
weights that disagree with config.json, damaged files and tokenizers, a config that names the
directory's own code, and Hugging Face's cache (a Hub id, a snapshot of links into ``blobs/``), each
refused in one line naming the file and the setting, or loaded, before any work. Lends
:func:`hub_snapshot` to tests/weights/test_pretrained_confinement.py."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import huggingface_hub
import pytest
from hydra.utils import instantiate
from support import forkserver
from support.paths import launcher_free, worker_pythonpath
from test_app_checks import compose_train, refusal
from test_train_e2e import FAST, ROOT, val_losses

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.checks import check_config
from pipeckpt.app.models.hf import HFCausalLM, hf_config
from pipeckpt.app.models.hf_directory import local_directory
from pipeckpt.app.tiny_pretrained import make_tiny_pretrained
from pipeckpt.weights.listing import INDEX

SMALL = ["data.max_bytes=200000", "trainer.accelerator=cpu", "trainer.max_steps=1"]
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(source: Path, cache: Path, repo: str = "org/tiny") -> Path:
    """``source``'s files as huggingface_hub caches them under ``cache``: blobs named by their hash in
    ``models--org--tiny/blobs/``, a snapshot of relative links to them, and ``refs/main``."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir()
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(REVISION)
    for file in sorted(source.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, folder / "blobs" / digest)
        (snapshot / file.name).symlink_to(f"../../blobs/{digest}")
    return snapshot


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


@pytest.fixture
def copy(tmp_path, tiny) -> Path:
    """A copy of the tiny directory to damage."""
    return Path(shutil.copytree(tiny, tmp_path / "copy"))


def run(
    out: Path, *overrides: str, env: Optional[Dict[str, str]] = None
) -> "subprocess.CompletedProcess[str]":
    """train.py on ``overrides``; with ``env``, in a fresh interpreter (huggingface_hub reads its
    variables when imported, which the fork server has done already)."""
    command = [sys.executable, "train.py", *FAST, f"hydra.run.dir={out}", *SMALL, *overrides]
    environment = dict(launcher_free(os.environ), PYTHONPATH=worker_pythonpath(), **(env or {}))
    if env:
        return subprocess.run(command, cwd=ROOT, env=environment, timeout=420, capture_output=True, text=True)
    return forkserver.run(command, cwd=ROOT, env=environment, timeout=420)


def _config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


def test_a_config_json_of_fewer_layers_than_the_weights_is_refused_naming_both_counts(copy):
    _config(copy, num_hidden_layers=2)
    with pytest.raises(PipeckptConfigError) as error:
        HFCausalLM(path=str(copy))
    assert "the checkpoint holds 4 of model.layers, the module 2" in str(error.value)
    assert f"the weights in model.path={copy} and its config.json disagree" in str(error.value)
    assert "model.ignore_keys" in str(error.value)


def test_model_ignore_keys_leaves_the_keys_it_matches_unread(tmp_path, copy):
    _config(copy, num_hidden_layers=2)
    ignore = "model.ignore_keys=['^model[.]layers[.][23][.]']"
    cfg = compose_train(tmp_path, "model=hf", f"model.path={copy}", ignore)
    check_config(cfg)
    assert instantiate(cfg.model).hf_config.num_hidden_layers == 2


def test_a_config_json_of_more_layers_than_the_weights_is_refused_before_anything_is_built(tmp_path, copy):
    _config(copy, num_hidden_layers=6)
    message = refusal(tmp_path, "model=hf", f"model.path={copy}")
    assert (
        "lacks model.layers.4." in message
        and "the checkpoint holds 4 of model.layers, the module 6" in message
    )


def test_train_py_refuses_a_truncated_shard_with_exit_1_naming_it_and_no_traceback(tmp_path, copy):
    shard = copy / json.loads((copy / INDEX).read_text())["weight_map"]["model.embed_tokens.weight"]
    shard.write_bytes(shard.read_bytes()[:-1000])
    done = run(tmp_path, "model=hf", f"model.path={copy}")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert f"shard {str(shard)!r}: " in done.stderr and "it is truncated" in done.stderr


def test_a_config_json_that_is_not_json_is_refused_naming_it(tmp_path, copy):
    (copy / "config.json").write_text('{"model_type": "llama",,}')
    message = refusal(tmp_path, "model=hf", f"model.path={copy}")
    assert message.startswith(
        f"model.path's config.json ({str(copy / 'config.json')!r}): it is not valid JSON"
    )


@pytest.mark.parametrize(
    "content, wrong",
    [
        (b'{"version": "1.0", ', "it is not valid JSON (Expecting"),
        (b'{"a": "\xff\xfe"}', "it is not UTF-8 text"),
    ],
    ids=["json", "utf8"],
)
def test_a_damaged_tokenizer_json_is_refused_naming_it(tmp_path, copy, content, wrong):
    (copy / "tokenizer.json").write_bytes(content)
    message = refusal(tmp_path, "model=hf", f"model.path={copy}")
    assert message.startswith(f"model.path's tokenizer.json ({str(copy / 'tokenizer.json')!r}): {wrong}")


def test_a_tokenizer_the_tokenizers_library_cannot_read_is_refused_naming_it(tmp_path, copy):
    (copy / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    message = refusal(tmp_path, "model=hf", f"model.path={copy}")
    assert message.startswith(f"data.tokenizer={copy}: transformers loads no tokenizer from it")


def _custom_code(path: Path, marker: Path) -> None:
    """``path``'s config.json names a model type of the directory's own code, which writes ``marker``."""
    _config(path, model_type="planted", auto_map={"AutoConfig": "configuration_planted.PlantedConfig"})
    (path / "configuration_planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig\n\n\n"
        "class PlantedConfig(LlamaConfig):\n    model_type = 'planted'\n"
    )


def test_train_py_refuses_a_directorys_own_code_in_one_line_naming_trust_remote_code(tmp_path, copy):
    marker = tmp_path / "code-ran"
    _custom_code(copy, marker)
    done = run(tmp_path / "run", "model=hf", f"model.path={copy}")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert "config.json's auto_map (configuration_planted.PlantedConfig)" in done.stderr
    assert "HINT: set model.trust_remote_code=true" in done.stderr
    assert not marker.exists()


def test_the_checks_before_anything_is_built_run_no_code_of_the_directory(tmp_path, copy):
    marker = tmp_path / "code-ran"
    _custom_code(copy, marker)
    check_config(compose_train(tmp_path, "model=hf", f"model.path={copy}"))
    assert not marker.exists()


def test_trust_remote_code_runs_the_directorys_code_when_asked(tmp_path, copy):
    marker = tmp_path / "code-ran"
    _custom_code(copy, marker)
    assert type(hf_config(str(copy), trust_remote_code=True)).__name__ == "PlantedConfig"
    assert marker.exists()


def test_an_auto_map_beside_a_model_type_transformers_has_builds_its_own_class_running_nothing(
    tmp_path, copy
):
    marker = tmp_path / "code-ran"
    _custom_code(copy, marker)
    _config(copy, model_type="llama")
    assert type(HFCausalLM(path=str(copy)).hf_config).__name__ == "LlamaConfig"
    assert not marker.exists()


def test_a_tokenizer_of_the_directorys_own_code_is_refused_naming_data_tokenizer(tmp_path, copy):
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.update(
        tokenizer_class="PlantedTokenizer", auto_map={"AutoTokenizer": ["tok.PlantedTokenizer", None]}
    )
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    message = refusal(tmp_path, "model=hf", f"model.path={copy}")
    assert message.startswith(
        f"data.tokenizer={copy}: tokenizer_config.json's auto_map (tok.PlantedTokenizer)"
    )


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_file_linked_outside_the_directory_is_refused_naming_it(tmp_path, copy, tiny, name):
    (copy / name).unlink()
    (copy / name).symlink_to(tiny / name)
    message = refusal(tmp_path, "model=hf", f"model.path={copy}")
    assert f"model.path's {name} names the file '{name}', which is a symbolic link" in message


def test_a_hub_id_names_its_snapshot_in_the_local_cache(tmp_path, tiny, monkeypatch):
    snapshot = hub_snapshot(tiny, tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert local_directory("org/tiny") == snapshot
    assert local_directory("org/absent") == Path("org/absent")  # refused by name as a missing path


def test_a_hub_id_absent_from_the_cache_is_refused_naming_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    message = refusal(tmp_path, "model=hf", "model.path=org/absent")
    assert message.startswith("model.path=org/absent: ") and "huggingface_hub's local cache" in message


def test_a_hub_snapshot_builds_the_model_and_reads_the_tokenizer_through_its_links(
    tmp_path, tiny, monkeypatch
):
    snapshot = hub_snapshot(tiny, tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    check_config(compose_train(tmp_path, "model=hf", "model.path=org/tiny"))
    assert compose_train(tmp_path, "model=hf", "model.path=org/tiny").data.tokenizer == str(snapshot)
    assert HFCausalLM(path="org/tiny").directory == snapshot


def test_train_py_fine_tunes_a_hub_id_from_the_cache_offline_as_its_directory(tmp_path, tiny):
    hub_snapshot(tiny, tmp_path / "hub")
    offline = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    by_id = run(tmp_path / "id", "model=hf", "model.path=org/tiny", env=offline)
    assert by_id.returncode == 0, by_id.stderr[-3000:]
    by_path = run(tmp_path / "path", "model=hf", f"model.path={tiny}")
    assert val_losses(by_id.stdout)[0] == val_losses(by_path.stdout)[0]
