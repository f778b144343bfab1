"""``data.sample_prompt`` (pipeckpt/app/sample.py): after a ``model=hf`` run, train.py prints the
trained model's greedy continuation of the prompt, the very ids ``transformers``' own greedy
``generate`` makes from the run's final weights; under the distributed engine the sample comes from
the run's export, and without one the line names the setting that makes one."""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from test_hf_model import train

import pipeckpt
from pipeckpt.app.sample import NEW_TOKENS, sample_after_training
from pipeckpt.app.tiny_pretrained import make_tiny_pretrained, tiny_config

PROMPT = "def main(argv):"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


def greedy(model: Any, ids: list) -> list:
    inputs = torch.tensor([ids])
    with torch.no_grad():
        return model.eval().generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()


def test_the_printed_continuation_is_transformers_greedy_generate_of_the_final_weights(tmp_path, tiny):
    prompt, steps = f"data.sample_prompt='{PROMPT}'", "trainer.max_steps=2"
    done = train(tmp_path, "model=hf", f"model.path={tiny}", prompt, steps, "model.lr=1e-3")  # weights move
    sample = json.loads((tmp_path / "sample.json").read_text())
    final = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    ids = transformers.AutoTokenizer.from_pretrained(tiny)(PROMPT, add_special_tokens=False).input_ids
    assert sample["prompt_ids"] + sample["new_ids"] != greedy(model, ids)  # the weights before training
    model.load_state_dict({k[len("model.") :]: v for k, v in final["state_dict"].items()})
    assert sample["prompt_ids"] + sample["new_ids"] == greedy(model, ids)
    line = next(line for line in done.stdout.splitlines() if line.startswith("sample ("))
    assert line.endswith(f"{PROMPT!r} -> {sample['continuation']!r}")


def distributed_trainer() -> Any:
    """What the sample reads of a trainer under the distributed engine (no process started)."""
    strategy = pipeckpt.PipelineStrategy(engine="distributed", stages=2)
    return SimpleNamespace(strategy=strategy)


def hf_module(model: Any) -> Any:
    return SimpleNamespace(model=model, trust_remote_code=False)


@pytest.fixture(scope="module")
def model() -> Any:
    return transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)


def test_without_a_tokenizer_the_prompt_is_its_utf8_bytes(tmp_path, model):
    data = SimpleNamespace(sample_prompt="é = 1", tokenizer=None)
    trainer = SimpleNamespace(strategy=None)
    sample_after_training(trainer, hf_module(model), data, export_dir=None, output_dir=tmp_path)
    sample = json.loads((tmp_path / "sample.json").read_text())
    assert sample["prompt_ids"] == list("é = 1".encode())
    assert sample["prompt_ids"] + sample["new_ids"] == greedy(model, list("é = 1".encode()))


def test_under_the_distributed_engine_the_sample_comes_from_the_export(tmp_path, tiny, model):
    model.save_pretrained(tmp_path / "export")
    data = SimpleNamespace(sample_prompt=PROMPT, tokenizer=str(tiny))
    line = sample_after_training(
        distributed_trainer(), hf_module(model), data, export_dir=tmp_path / "export", output_dir=tmp_path
    )
    sample = json.loads((tmp_path / "sample.json").read_text())
    assert line is not None and f"from the export {tmp_path / 'export'}" in line
    assert sample["prompt_ids"] + sample["new_ids"] == greedy(model, sample["prompt_ids"])


def test_under_the_distributed_engine_without_an_export_the_line_names_the_export_setting(tmp_path, model):
    data = SimpleNamespace(sample_prompt=PROMPT, tokenizer=None)
    line = sample_after_training(
        distributed_trainer(), hf_module(model), data, export_dir=None, output_dir=tmp_path
    )
    assert line is not None and "+callbacks.export=" in line and "pipeckpt.export.HFExport" in line
    assert not (tmp_path / "sample.json").exists()


def test_without_a_prompt_there_is_no_sample(tmp_path, model):
    data = SimpleNamespace(sample_prompt=None, tokenizer=None)
    assert sample_after_training(None, hf_module(model), data, export_dir=None, output_dir=tmp_path) is None
