"""The export of a run fine-tuned from a pretrained directory (the app's ``model=hf`` on
pipeckpt.app.tiny_pretrained's tiny Llama: bf16 shards and a BPE tokenizer, trained 2 steps in 2
stages in float32): it never writes into that directory, keeps its bf16, carries its tokenizer and
generation files, needs no --prefix or --config (the checkpoint names them), and refuses a config
of another model, or one that needs the directory's own code, before writing anything."""

import json
import shutil
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
import transformers
from support.hf_models import batches

import pipeckpt
from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.models.hf import HFCausalLM
from pipeckpt.app.tiny_pretrained import make_tiny_pretrained, tiny_config
from pipeckpt.export import HFExport, export_hf
from pipeckpt.export.__main__ import main as cli
from pipeckpt.state.safe_load import load_torch_file

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _fit(module, tmp_path: Path, callbacks=()) -> Path:
    from support.trainers import quiet_trainer

    trainer = quiet_trainer(
        pipeckpt.PipelineStrategy(stages=2, chunks=2), max_steps=STEPS, callbacks=list(callbacks)
    )
    trainer.fit(module, DataLoader(batches(STEPS), batch_size=None))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    return tmp_path / "run.ckpt"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Tuple[Path, Path]:
    """(the tiny pretrained directory, the checkpoint of a model=hf run fine-tuned from it)."""
    torch.set_num_threads(1)
    where = tmp_path_factory.mktemp("pretrained")
    tiny = make_tiny_pretrained(where / "tiny-llama", "llama")
    return tiny, _fit(HFCausalLM(path=str(tiny), seq_len=12), where)


def _trained(ckpt: Path) -> Dict[str, torch.Tensor]:
    state = load_torch_file(ckpt, weights_only=True)["state_dict"]
    return {k.removeprefix("model."): v for k, v in state.items()}


def _files(directory: Path) -> Dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        cli([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1, err  # one line, no traceback
    return err


def test_an_export_onto_its_pretrained_directory_is_refused_and_leaves_it_unchanged(run, tmp_path, capsys):
    tiny, ckpt = run
    source = Path(shutil.copytree(tiny, tmp_path / "no-tokenizer"))
    for name in TOKENIZER_FILES:
        (source / name).unlink()  # only names an export writes are left: config.json, shards, index
    before = _files(source)
    err = _refusal([ckpt, source, "--prefix", "model.", "--config", source], capsys)
    assert "is the pretrained directory the export reads" in err
    assert _files(source) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-tokenizer"]  # nothing left beside it


def test_an_export_of_a_bf16_pretrained_model_is_bf16_by_default(run, tmp_path):
    tiny, ckpt = run
    out = export_hf(ckpt, tmp_path / "hf", prefix="model.", config=tiny)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    trained = _trained(ckpt)
    assert next(iter(trained.values())).dtype == torch.float32  # trained in float32
    assert {v.dtype for v in loaded.state_dict().values()} == {torch.bfloat16}
    assert all(torch.equal(v, trained[k].to(torch.bfloat16)) for k, v in loaded.state_dict().items())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_dtype_checkpoint_keeps_the_trained_float32_weights_exactly(run, tmp_path):
    tiny, ckpt = run
    out = export_hf(ckpt, tmp_path / "hf", prefix="model.", config=tiny, dtype="checkpoint")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").state_dict()
    trained = _trained(ckpt)
    assert all(v.dtype == torch.float32 and torch.equal(v, trained[k]) for k, v in loaded.items())


def test_autotokenizer_loads_the_export_and_encodes_as_the_pretrained_directory(run, tmp_path):
    tiny, ckpt = run
    out = export_hf(ckpt, tmp_path / "hf", prefix="model.", config=tiny)
    text = "def export(checkpoint):\n    return checkpoint\n"
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported(text)["input_ids"] == transformers.AutoTokenizer.from_pretrained(tiny)(text)["input_ids"]
    assert all((out / name).read_bytes() == (tiny / name).read_bytes() for name in TOKENIZER_FILES)


def test_the_pretrained_directorys_generation_config_is_copied(run, tmp_path):
    tiny, ckpt = run
    source = Path(shutil.copytree(tiny, tmp_path / "source"))
    settings = json.loads((source / "generation_config.json").read_text())
    (source / "generation_config.json").write_text(json.dumps(dict(settings, max_length=77)))
    out = export_hf(ckpt, tmp_path / "hf", prefix="model.", config=source)
    assert transformers.GenerationConfig.from_pretrained(out).max_length == 77


def test_after_a_model_hf_run_the_cli_needs_no_prefix_or_config(run, tmp_path):
    _, ckpt = run
    cli([str(ckpt), str(tmp_path / "hf")])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto").state_dict()
    trained = _trained(ckpt)
    assert sorted(loaded) == sorted(trained)
    assert all(torch.equal(v, trained[k].to(torch.bfloat16)) for k, v in loaded.items())
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").vocab_size > 256


def test_after_a_model_hf_run_from_a_config_the_export_builds_that_config(tmp_path):
    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64}
    ckpt = _fit(HFCausalLM(config=config, seq_len=12), tmp_path)
    out = export_hf(ckpt, tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is transformers.GPT2LMHeadModel and loaded.config.n_layer == 2
    trained = _trained(ckpt)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())


def _config_dir(path: Path, **fields) -> Path:
    config = tiny_config("llama", **fields)
    config.architectures = ["LlamaForCausalLM"]  # as a pretrained directory's names its class
    config.save_pretrained(path)
    return path


def test_a_config_of_another_vocabulary_is_refused_naming_the_key_and_both_shapes(run, tmp_path, capsys):
    tiny, ckpt = run
    vocab = transformers.AutoConfig.from_pretrained(tiny).vocab_size
    other = _config_dir(tmp_path / "cfg", vocab_size=256)
    err = _refusal([ckpt, tmp_path / "hf", "--prefix", "model.", "--config", other], capsys)
    assert f"model.embed_tokens.weight: ({vocab}, 64) stored, (256, 64) in the config's model" in err
    assert not (tmp_path / "hf").exists()


def test_a_config_with_fewer_layers_is_refused_naming_the_layers_it_would_leave_out(run, tmp_path):
    tiny, ckpt = run
    vocab = transformers.AutoConfig.from_pretrained(tiny).vocab_size
    other = _config_dir(tmp_path / "cfg", vocab_size=vocab)
    config = transformers.AutoConfig.from_pretrained(other)
    config.num_hidden_layers = 2
    with pytest.raises(PipeckptConfigError, match=r"model has no place for.*'model\.layers\.2\.") as error:
        export_hf(ckpt, tmp_path / "hf", prefix="model.", config=config)
    assert "would leave them out" in str(error.value) and not (tmp_path / "hf").exists()


def test_a_config_that_needs_remote_code_is_refused_in_one_line_and_runs_none_of_it(
    run, tmp_path, capsys, monkeypatch
):
    _, ckpt = run
    custom = tmp_path / "custom"
    custom.mkdir()
    auto_map = {"AutoConfig": "configuration_custom.CustomConfig"}
    fields = {"model_type": "pipeckpt_custom", "auto_map": auto_map, "architectures": ["CustomModel"]}
    (custom / "config.json").write_text(json.dumps(fields))
    (custom / "configuration_custom.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("the export asked a question"))
    err = _refusal([ckpt, tmp_path / "hf", "--prefix", "model.", "--config", custom], capsys)
    assert "code of its own (auto_map)" in err and "trust_remote_code=False" in err and "HINT" in err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "hf").exists()


def test_hfexport_of_a_pretrained_run_is_bf16_with_the_directorys_tokenizer(run, tmp_path):
    tiny, _ = run
    module = HFCausalLM(path=str(tiny), seq_len=12)
    _fit(module, tmp_path, callbacks=[HFExport(tmp_path / "hf")])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    want = {k: v.detach().to(torch.bfloat16) for k, v in module.model.state_dict().items()}
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").vocab_size > 256


def test_a_directory_of_another_models_shards_is_refused_though_an_export_writes_such_names(
    run, tmp_path, capsys
):
    tiny, ckpt = run
    other = Path(shutil.copytree(tiny, tmp_path / "other"))
    for name in TOKENIZER_FILES:
        (other / name).unlink()  # config.json, generation_config.json and shards: no record of an export
    before = _files(other)
    err = _refusal([ckpt, other, "--prefix", "model.", "--config", tiny], capsys)
    assert "which no export wrote" in err and "config.json" in err
    assert _files(other) == before


def test_hfexport_onto_the_pretrained_directory_is_refused_at_fit_start_and_leaves_it_unchanged(
    run, tmp_path
):
    tiny, _ = run
    source = Path(shutil.copytree(tiny, tmp_path / "source"))
    before = _files(source)
    module = HFCausalLM(path=str(source), seq_len=12)
    with pytest.raises(PipeckptConfigError, match=r"HFExport dirpath=.*is the pretrained directory"):
        _fit(module, tmp_path, callbacks=[HFExport(source)])
    assert _files(source) == before and not (tmp_path / "run.ckpt").exists()
