"""The export to Hugging Face from a local engine's checkpoint (pipeckpt.export): tiny random GPT-2
(tied) and Llama trained 3 steps in 2 stages, then written as a directory that ``from_pretrained``
loads with the trained weights exactly, in several safetensors shards with their index, no optimizer
state, one shard's keys read at a time; PEFT LoRA's adapters for ``PeftModel.from_pretrained``; the
CLI and the ``HFExport`` callback."""

import json
from pathlib import Path
from typing import Dict

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
import transformers
from support.hf_models import HFModule, batches, whole

import pipeckpt
from pipeckpt._errors import PipeckptConfigError
from pipeckpt.export import HFExport, export_hf
from pipeckpt.export import hf as export_hf_module
from pipeckpt.export.__main__ import main as cli
from pipeckpt.export.target import RECORD

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 3
SMALL_SHARD = 20_000  # bytes: the tiny models' ~100 KiB in several shards


def _train(module, quiet_trainer, tmp_path: Path, callbacks=()) -> Path:
    strategy = pipeckpt.PipelineStrategy(stages=2, chunks=2)
    trainer = quiet_trainer(strategy, max_steps=STEPS, callbacks=list(callbacks))
    trainer.fit(module, DataLoader(batches(STEPS), batch_size=None))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Dict[str, object]:
    """Each model trained once: its module and its checkpoint."""
    from support.trainers import quiet_trainer

    torch.set_num_threads(1)
    out = {}
    for name in ("gpt2", "llama"):
        module = HFModule(name, whole)
        out[name] = (module, _train(module, quiet_trainer, tmp_path_factory.mktemp(name)))
    return out


def _export(module, ckpt: Path, tmp_path: Path, **options) -> Path:
    model = module.model
    return export_hf(
        ckpt, tmp_path / "hf", prefix="model.", config=model.config, model_class=type(model), **options
    )


def _hf_state(module) -> Dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.model.state_dict().items()}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_from_pretrained_loads_the_trained_weights_exactly_and_gives_equal_logits(trained, name, tmp_path):
    module, ckpt = trained[name]
    out = _export(module, ckpt, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(module.model)
    got, want = loaded.state_dict(), _hf_state(module)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    ids = batches(1)[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, module.model.eval()(ids).logits)


def test_a_tied_copy_is_left_out_as_save_pretrained_leaves_it(trained, tmp_path):
    module, ckpt = trained["gpt2"]
    out = _export(module, ckpt, tmp_path, max_shard_size=SMALL_SHARD)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index and "transformer.wte.weight" in index
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_a_small_max_shard_size_gives_several_shards_and_an_index_naming_each_key(trained, tmp_path):
    module, ckpt = trained["llama"]
    out = _export(module, ckpt, tmp_path, max_shard_size=SMALL_SHARD)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert sorted(index["weight_map"]) == sorted(_hf_state(module))


def test_the_export_holds_no_optimizer_state_only_config_and_weights(trained, tmp_path):
    module, ckpt = trained["llama"]
    out = _export(module, ckpt, tmp_path, max_shard_size=SMALL_SHARD)
    files = {p.name for p in out.iterdir()}
    assert files - {"config.json", "generation_config.json", "model.safetensors.index.json", RECORD} == {
        p.name for p in out.glob("model-*-of-*.safetensors")
    }
    from safetensors.torch import load_file

    stored = sum(len(load_file(str(p))) for p in out.glob("*.safetensors"))
    assert stored == len(_hf_state(module))  # the model's tensors, nothing else


def test_each_read_of_the_checkpoint_asks_for_at_most_one_shards_keys(trained, tmp_path, source_reads):
    module, ckpt = trained["llama"]
    reads = source_reads
    out = _export(module, ckpt, tmp_path, max_shard_size=SMALL_SHARD)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(reads) == len(set(index.values())) > 2
    for keys in reads:
        assert len({index[k.removeprefix("model.")] for k in keys}) == 1


def test_a_shard_is_read_a_few_tensors_at_a_time_and_still_loads_exactly(
    trained, tmp_path, monkeypatch, source_reads
):
    module, ckpt = trained["llama"]
    budget = 4096  # bytes: the tiny Llama's one shard read in many groups
    monkeypatch.setattr(export_hf_module, "READ_BYTES", budget)
    reads = source_reads
    out = _export(module, ckpt, tmp_path)
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"] and len(reads) > 2
    want = _hf_state(module)
    for keys in reads:
        size = sum(want[k.removeprefix("model.")].numel() * 4 for k in keys)
        assert size <= budget or len(keys) == 1, keys
    assert sorted(k for keys in reads for k in keys) == sorted("model." + k for k in want)
    got = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_bfloat16_export_casts_every_weight_and_says_so_in_the_config(trained, tmp_path):
    module, ckpt = trained["llama"]
    out = _export(module, ckpt, tmp_path, dtype="bfloat16")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    want = _hf_state(module)
    assert all(torch.equal(v, want[k].to(torch.bfloat16)) for k, v in loaded.state_dict().items())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_wrong_prefix_is_refused_naming_it_and_the_keys_found(trained, tmp_path):
    module, ckpt = trained["llama"]
    with pytest.raises(PipeckptConfigError, match=r"prefix='net\.'.*model\.") as error:
        export_hf(
            ckpt, tmp_path / "hf", prefix="net.", config=module.model.config, model_class=type(module.model)
        )
    assert "HINT" in str(error.value)
    assert not (tmp_path / "hf").exists() and list(tmp_path.iterdir()) == []


def test_the_cli_exports_from_a_saved_config_directory(trained, tmp_path):
    module, ckpt = trained["gpt2"]
    module.model.config.save_pretrained(tmp_path / "cfg")
    cli([str(ckpt), str(tmp_path / "hf"), "--prefix", "model.", "--config", str(tmp_path / "cfg"),
         "--model-class", "GPT2LMHeadModel", "--max-shard-size", str(SMALL_SHARD)])  # fmt: skip
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = _hf_state(module)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def test_the_callback_writes_the_export_when_fit_ends(quiet_trainer, tmp_path):
    module = HFModule("llama", whole)
    _train(module, quiet_trainer, tmp_path, callbacks=[HFExport(tmp_path / "hf", max_shard_size=SMALL_SHARD)])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = _hf_state(module)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run.ckpt"]  # its weights removed


def test_lora_adapters_load_with_peft_and_equal_the_trained_ones(quiet_trainer, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from support.frozen_models import LoraLlama

    module = LoraLlama()
    ckpt = _train(module, quiet_trainer, tmp_path)
    peft_model = module.model
    out = export_hf(
        ckpt, tmp_path / "adapter", prefix="model.", config=peft_model.get_base_model().config,
        model_class=transformers.LlamaForCausalLM, adapter_config=peft_model.peft_config["default"],
    )  # fmt: skip
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(peft_model.get_base_model().config)  # LoraLlama's base, seed 0
    loaded = PeftModel.from_pretrained(base, out)
    trained_lora = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    got = loaded.state_dict()
    assert trained_lora and all(torch.equal(got[k], v) for k, v in trained_lora.items())
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in trained_lora.items() if "lora_B" in k)
    ids = batches(1)[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, peft_model.eval()(ids).logits)


def test_an_export_replaces_an_earlier_export_whole(trained, tmp_path):
    module, ckpt = trained["llama"]
    _export(module, ckpt, tmp_path, max_shard_size=SMALL_SHARD)
    out = _export(module, ckpt, tmp_path)  # one file now: the shards and index of the first are gone
    assert sorted(p.name for p in out.iterdir()) == [
        RECORD,
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_a_directory_holding_other_files_is_refused_and_left_as_it_was(trained, tmp_path):
    module, ckpt = trained["llama"]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(
        PipeckptConfigError, match=r"out=.*\['notes.txt'\].*no export wrote.*replaces its directory whole"
    ):
        _export(module, ckpt, tmp_path)
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["notes.txt"]


def test_the_callback_refuses_a_dtype_before_training():
    with pytest.raises(PipeckptConfigError, match=r"dtype='float16'.*float32 or bfloat16"):
        HFExport("out", dtype="float16")


def test_the_cli_names_a_wrong_prefix_and_exits_2(trained, tmp_path, capsys):
    module, ckpt = trained["gpt2"]
    module.model.config.save_pretrained(tmp_path / "cfg")
    argv = [str(ckpt), str(tmp_path / "hf"), "--prefix", "gpt.", "--config", str(tmp_path / "cfg")]
    with pytest.raises(SystemExit) as exit:
        cli([*argv, "--model-class", "GPT2LMHeadModel"])
    assert exit.value.code == 2 and "prefix='gpt.'" in capsys.readouterr().err


def test_an_incomplete_sharded_directory_is_refused_naming_what_it_lacks(tmp_path):
    (tmp_path / "run.ckpt").mkdir()
    (tmp_path / "run.ckpt" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(PipeckptConfigError, match=r"has no \.metadata .* and no pipeckpt-meta\.pt"):
        export_hf(tmp_path / "run.ckpt", tmp_path / "hf", prefix="model.", config=transformers.GPT2Config())
