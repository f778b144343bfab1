"""``model=hf``: a Hugging Face causal LM fine-tuned by train.py from a local pretrained directory
(pipeckpt.app.tiny_pretrained's tiny Llama: bf16 shards and a BPE tokenizer), built on the meta device
and filled from the directory, under the local engine and the distributed one (2 processes). The
validation loss before training equals ``from_pretrained(dir, dtype=float32)``'s on the same
batches, so the run starts at the directory's weights; the run trains to a finite loss and writes its
checkpoint. Bad directories and data that do not fit the model are refused by name before any work."""

import math
import os
import sys
from pathlib import Path
from typing import Any, List

import pytest
import torch
import transformers
from support import forkserver
from support.paths import launcher_free, worker_pythonpath
from test_app_checks import compose_train, refusal
from test_train_e2e import FAST, ROOT, val_losses

from pipeckpt.app.checks import check_config
from pipeckpt.app.data.hf_text import HFTextDataModule
from pipeckpt.app.models.hf import decoder_layers, hf_config
from pipeckpt.app.tiny_pretrained import make_tiny_pretrained, tiny_config

SMALL = ["data.max_bytes=200000", "trainer.accelerator=cpu"]  # a second's tokenizing
VAL_BATCHES = 2  # trainer=fast's limit_val_batches


def train(out: Path, *overrides: str) -> Any:
    command = [sys.executable, "train.py", *FAST, f"hydra.run.dir={out}", *SMALL, *overrides]
    env = dict(launcher_free(os.environ), PYTHONPATH=worker_pythonpath())  # a second process imports it too
    done = forkserver.run(command, cwd=ROOT, env=env, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def reference_val_loss(tiny) -> float:
    """``from_pretrained``'s mean loss on the batches train.py validates on."""
    data = HFTextDataModule(tokenizer=str(tiny), seq_len=128, batch_size=16, max_bytes=200_000)
    data.setup("validate")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    losses: List[float] = []
    with torch.no_grad():
        for batch, _ in zip(data.val_dataloader(), range(VAL_BATCHES)):
            losses.append(model(**batch).loss.item())
    return sum(losses) / len(losses)


def test_model_hf_fine_tunes_the_directory_under_the_local_engine(tmp_path, tiny, reference_val_loss):
    done = train(tmp_path, "model=hf", f"model.path={tiny}")
    start, end = val_losses(done.stdout)
    assert start == pytest.approx(reference_val_loss, abs=1e-4)  # printed to 4 decimals
    assert math.isfinite(end) and end != start
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
def test_model_hf_fine_tunes_the_directory_on_two_distributed_processes(tmp_path, tiny, reference_val_loss):
    done = train(
        tmp_path, "model=hf", f"model.path={tiny}", "strategy.engine=distributed", "trainer.devices=2"
    )
    start, end = val_losses(done.stdout)
    assert start == pytest.approx(reference_val_loss, abs=1e-4)
    assert math.isfinite(end) and end != start
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_the_directorys_tokenizer_makes_the_ids_and_bytes_do_without_one(tmp_path, tiny):
    text = b"def f(x):\n    return x + 1\n" * 40
    (tmp_path / "corpus.py").write_bytes(text)
    kwargs = dict(path=str(tmp_path / "corpus.py"), seq_len=16, batch_size=1, val_fraction=0.1)
    with_tokenizer = HFTextDataModule(tokenizer=str(tiny), **kwargs)
    with_tokenizer.setup("fit")
    ids = transformers.AutoTokenizer.from_pretrained(tiny)(text.decode(), add_special_tokens=False).input_ids
    assert with_tokenizer.train_set[0]["input_ids"].tolist() == ids[:16]
    assert with_tokenizer.train_set[0]["labels"].tolist() == ids[:16]  # the model shifts them itself
    as_bytes = HFTextDataModule(tokenizer=str(tmp_path), **kwargs)  # a directory without a tokenizer
    as_bytes.setup("fit")
    assert as_bytes.train_set[0]["input_ids"].tolist() == list(text[:16])


def test_a_missing_model_path_is_refused_naming_it(tmp_path):
    message = refusal(tmp_path, "model=hf", f"model.path={tmp_path / 'nowhere'}")
    assert (
        message.startswith(f"model.path={tmp_path / 'nowhere'}: ") and "no such file or directory" in message
    )


def test_a_directory_without_config_json_is_refused_naming_it(tmp_path):
    message = refusal(tmp_path, "model=hf", f"model.path={tmp_path}")
    assert message.startswith(f"model.path={tmp_path}: ") and "without a config.json" in message


def test_bytes_outside_the_models_vocabulary_are_refused_naming_the_directory(tmp_path):
    transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=128)).save_pretrained(
        tmp_path
    )
    message = refusal(tmp_path, "model=hf", f"model.path={tmp_path}")
    assert message.startswith(f"model.path={tmp_path} (vocab_size 128) with the text's bytes (no tokenizer)")


def test_a_window_longer_than_the_models_positions_is_refused(tmp_path, tiny):
    assert refusal(tmp_path, "model=hf", f"model.path={tiny}", "model.seq_len=300").startswith(
        "model.seq_len=300: "
    )


def test_a_directory_and_a_config_together_are_refused(tmp_path, tiny):
    message = refusal(tmp_path, "model=hf", f"model.path={tiny}", "model.config={model_type:gpt2}")
    assert message.startswith(f"model.path={tiny} with model.config=")


T5 = "{model_type:t5,d_model:32,d_ff:64,num_layers:1,num_heads:2,d_kv:16,vocab_size:256}"


def test_a_config_of_an_encoder_decoder_is_refused_naming_its_model_type(tmp_path):
    message = refusal(tmp_path, "model=hf", f"model.config={T5}")
    assert message.startswith("model.config (model_type 't5'): model=hf trains a causal language model")
    assert "pipeline_of" in message  # the fix: the user's own script


def test_a_directory_of_an_encoder_decoder_is_refused_naming_it(tmp_path):
    config = transformers.AutoConfig.for_model("t5", d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    message = refusal(tmp_path, "model=hf", f"model.path={tmp_path / 't5'}")
    assert message.startswith(f"model.path={tmp_path / 't5'} (model_type 't5'): model=hf trains a causal")


def test_a_config_dict_builds_that_model_type_with_its_fields(tmp_path):
    cfg = compose_train(tmp_path, "model=hf", "model.config={model_type:gpt2,n_layer:3,n_embd:32,n_head:2}")
    check_config(cfg)
    built = hf_config(None, cfg.model.config)
    assert (type(built).__name__, built.n_layer, built.n_embd) == ("GPT2Config", 3, 32)


def test_a_config_json_builds_that_config_from_scratch(tmp_path, tiny):
    cfg = compose_train(tmp_path, "model=hf", f"model.config={tiny / 'config.json'}")
    check_config(cfg)
    built, saved = hf_config(None, cfg.model.config), transformers.AutoConfig.from_pretrained(tiny)
    assert type(built) is type(saved)
    assert {k: v for k, v in built.to_dict().items() if k != "_name_or_path"} == {
        k: v for k, v in saved.to_dict().items() if k != "_name_or_path"
    }


def test_without_a_pipeline_model_hf_loads_the_directory_eagerly(tmp_path, tiny, reference_val_loss):
    start, end = val_losses(train(tmp_path, "model=hf", f"model.path={tiny}", "strategy=single").stdout)
    assert start == pytest.approx(reference_val_loss, abs=1e-4)
    assert math.isfinite(end) and end != start


@pytest.mark.parametrize(
    "family,layers", [("llama", "model.layers"), ("qwen2", "model.layers"), ("gpt2", "transformer.h")]
)
def test_the_decoder_layers_are_the_modulelist_holding_most_parameters(family, layers):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(family))
    assert decoder_layers(model) == layers


def test_the_tiny_directory_holds_bf16_shards_and_a_tokenizer_of_the_models_vocabulary(tiny):
    from safetensors import safe_open

    shards = sorted(tiny.glob("*.safetensors"))
    assert len(shards) > 2 and (tiny / "model.safetensors.index.json").is_file()
    with safe_open(str(shards[0]), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    config = transformers.AutoConfig.from_pretrained(tiny)
    assert len(transformers.AutoTokenizer.from_pretrained(tiny)) == config.vocab_size > 256
