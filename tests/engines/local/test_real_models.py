"""Two models nobody here wrote, used unmodified: Hugging Face GPT2LMHeadModel (tied embeddings,
a padding mask) and lightning.pytorch.demos.Transformer (encoder output read by every decoder
layer), each pipelined into 2 and 4 stages with ``pipeline_of``. Gradients equal the unpipelined
model's within 1e-5 (dropout off) and are bitwise equal across modes (dropout on); checkpoints
hold the model's own keys and load strict=True into the unmodified model."""

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import pipeckpt
from pipeckpt import PipeckptConfigError, pipeline_of
from pipeckpt.engines.local.module import ModuleRunner
from pipeckpt.stages.partition import plan

CPU = [torch.device("cpu")]
MODES = ["never", "except_last", "always", "offload", ["always", "never", "except_last", "never"]]
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def modes_for(stages: int) -> list:
    return [m if isinstance(m, str) else m[:stages] for m in MODES]


# -- the two clients -------------------------------------------------------------------


def gpt2(dropout: float) -> Tuple[nn.Module, Tuple[str, ...], Callable[[nn.Module], Tensor]]:
    ex = example("gpt2_pipeline")
    torch.manual_seed(0)
    model = ex.GPT2LMHeadModel(ex.config(dropout))
    ids, mask = next(iter(ex.data()))

    def loss(m: nn.Module) -> Tensor:
        logits = m(ids, attention_mask=mask).logits
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)

    return model, ("transformer.h",), loss


def demo(dropout: float) -> Tuple[nn.Module, Tuple[str, ...], Callable[[nn.Module], Tensor]]:
    ex = example("demo_transformer_pipeline")
    torch.manual_seed(0)
    model = ex.DemoModule(dropout=dropout).model
    inputs, target = next(iter(ex.data()))
    return (
        model,
        ("transformer.encoder.layers", "transformer.decoder.layers"),
        lambda m: F.nll_loss(m(inputs, target), target.flatten()),
    )


CLIENTS = {"gpt2": gpt2, "demo": demo}


def grads(model: nn.Module) -> Dict[str, Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def unpipelined(client: str) -> Dict[str, Tensor]:
    model, _, loss = CLIENTS[client](0.0)
    loss(model).backward()
    return grads(model)


def pipelined(client: str, stages: int, mode: Any, dropout: float) -> Dict[str, Tensor]:
    model, layers, loss = CLIENTS[client](dropout)
    model.train()
    runner = ModuleRunner(
        pipeline_of(model, *layers),
        plan(pipeline_of(model, *layers), devices=CPU, stages=stages, checkpoint=mode),
        chunks=4,
    )
    torch.manual_seed(5)
    loss(model).backward()
    runner.restore()
    return grads(model)


@pytest.fixture(scope="module", params=["gpt2", "demo"])
def client(request: Any) -> str:
    if request.param == "gpt2":
        pytest.importorskip("transformers")
    return request.param


@pytest.mark.parametrize("stages", [2, 4])
def test_gradients_match_the_unpipelined_model_in_every_mode(client, stages):
    expected = unpipelined(client)
    for mode in modes_for(stages):
        got = pipelined(client, stages, mode, 0.0)
        assert got.keys() == expected.keys()
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-5, msg=f"{mode} {k}")


@pytest.mark.parametrize("stages", [2, 4])
def test_gradients_bitwise_equal_across_modes_with_dropout(client, stages):
    never = pipelined(client, stages, "never", 0.2)
    for mode in modes_for(stages)[1:]:
        got = pipelined(client, stages, mode, 0.2)
        for k in never:
            assert torch.equal(got[k], never[k]), f"{mode} {k}"


def test_gpt2_tied_embedding_is_one_parameter_with_both_uses_summed():
    pytest.importorskip("transformers")
    model, _layers, _loss = gpt2(0.0)
    assert model.lm_head.weight is model.transformer.wte.weight
    expected = unpipelined("gpt2")
    got = pipelined("gpt2", 4, "always", 0.0)
    assert "lm_head.weight" not in got  # named_parameters() names the tied weight once
    torch.testing.assert_close(
        got["transformer.wte.weight"], expected["transformer.wte.weight"], rtol=0, atol=1e-5
    )


# -- through the Trainer: keys and checkpoints ---------------------------------------------


def fit_example(name: str, module_class: str, stages: int, tmp_path: Path) -> Tuple[nn.Module, Path]:
    ex = example(name)
    torch.manual_seed(0)
    module = getattr(ex, module_class)(*((ex.config(),) if name == "gpt2_pipeline" else ()))
    keys = list(module.state_dict())
    trainer = L.Trainer(
        strategy=pipeckpt.PipelineStrategy(stages=stages, chunks=4, checkpoint="except_last"),
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, ex.data())
    assert list(module.state_dict()) == keys  # no wrapper prefix, no duplicate
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    return module, path


@pytest.mark.parametrize("stages", [2, 4])
def test_gpt2_checkpoint_loads_strict_into_the_unmodified_model(stages, tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    module, path = fit_example("gpt2_pipeline", "GPT2Module", stages, tmp_path)
    state = torch.load(path, weights_only=True)["state_dict"]
    plain = GPT2LMHeadModel(example("gpt2_pipeline").config())
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    assert torch.equal(plain.transformer.h[3].mlp.c_fc.weight, module.model.transformer.h[3].mlp.c_fc.weight)


@pytest.mark.parametrize("stages", [2, 4])
def test_demo_checkpoint_loads_strict_into_the_unmodified_model(stages, tmp_path):
    from lightning.pytorch.demos import Transformer

    module, path = fit_example("demo_transformer_pipeline", "DemoModule", stages, tmp_path)
    state = torch.load(path, weights_only=True)["state_dict"]
    plain = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=2)
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    assert torch.equal(plain.decoder.weight, module.model.decoder.weight)
    assert "forward" not in module.model.__dict__  # teardown gave the model its own forward back


# -- what pipeline_of refuses -------------------------------------------------------------


def test_pipeline_of_names_a_missing_layer_list():
    model, _, _ = demo(0.0)
    with pytest.raises(
        PipeckptConfigError, match=r"pipeline_of\(\.\.\., 'transformer\.h'\): Transformer has no"
    ):
        pipeline_of(model, "transformer.h")


def test_pipeline_of_refuses_a_layer_named_twice():
    model, _, _ = demo(0.0)
    with pytest.raises(PipeckptConfigError, match=r"names the layer 'transformer.encoder.layers.0' twice"):
        pipeline_of(model, "transformer.encoder.layers", "transformer.encoder.layers.0")


def test_checkpointed_layers_recompute_each_call_once(client):
    model, layers, loss = CLIENTS[client](0.0)
    counts = {}
    for mode in ("never", "always"):
        spec = pipeline_of(model, *layers)
        runner = ModuleRunner(spec, plan(spec, devices=CPU, stages=2, checkpoint=mode), chunks=4)
        loss(model).backward()
        runner.restore()
        counts[mode] = sum(s.forward_calls for s in runner.stages)
    assert counts == {"never": 4 * len(spec), "always": 2 * 4 * len(spec)}
