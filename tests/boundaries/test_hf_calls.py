"""Hugging Face's own calls, unchanged, through the pipeline: ``self.model(**batch).loss`` and
keyword-only calls. The batch dimension comes from the keyword tensors; the loss each micro-batch
computes is combined into the whole batch's (a mean over label tokens weighted by each
micro-batch's count, a sum added up, anything else warned about). GPT-2 and Llama (tiny random
configs, dropout 0) train through a real Trainer equal within 1e-5 to the unpipelined module."""

from typing import Any, Callable, Dict

import pytest
import torch
from support.trainers import quiet_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader

import pipeckpt
from pipeckpt import PipeckptWarning, pipeline_of
from pipeckpt.boundaries.microbatch import batch_size, gather, scatter
from pipeckpt.boundaries.scalars import loss_weights, shifts_labels

transformers = pytest.importorskip("transformers")
from support.hf_models import LAYERS, MODELS, VOCAB, HFModule, batches, gpt2, keywords, llama, whole  # noqa: E402


def trained(name: str, step: Callable[..., Tensor], strategy: Any = None) -> Dict[str, Tensor]:
    module = HFModule(name, step)
    loader = DataLoader(batches(), batch_size=None)
    quiet_trainer(strategy, max_steps=2).fit(module, loader)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_close(got: Dict[str, Tensor], want: Dict[str, Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


def pipe(**options: Any) -> pipeckpt.PipelineStrategy:
    return pipeckpt.PipelineStrategy(stages=2, chunks=4, checkpoint="except_last", **options)


# -- through a real Trainer ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_of_the_batch_dict_trains_as_unpipelined(name):
    assert_close(trained(name, whole, pipe()), trained(name, whole))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_keyword_only_call_trains_as_unpipelined(name):
    assert_close(trained(name, keywords, pipe()), trained(name, keywords))


def test_never_and_always_train_as_unpipelined():
    want = trained("gpt2", whole)
    for mode in ("never", "always"):
        strategy = pipeckpt.PipelineStrategy(stages=2, chunks=4, checkpoint=mode)
        assert_close(trained("gpt2", whole, strategy), want)


# -- the combined loss and its gradients, without a Trainer --------------------------------


def routed(name: str, chunks: int = 4) -> nn.Module:
    from pipeckpt.engines.local.module import ModuleRunner
    from pipeckpt.stages.partition import plan

    torch.manual_seed(0)
    model = MODELS[name]()
    spec = pipeline_of(model, LAYERS[name])
    stages_plan = plan(spec, devices=[torch.device("cpu")], stages=2, checkpoint="never", chunks=chunks)
    ModuleRunner(spec, stages_plan, chunks=chunks)
    return model


def grads(model: nn.Module) -> Dict[str, Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_token_mean_loss_and_gradients_equal_the_whole_batch(name):
    batch = batches(1)[0]
    torch.manual_seed(0)
    plain = MODELS[name]()
    want = plain(**batch).loss
    want.backward()
    model = routed(name)
    got = model(**batch).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert_close(grads(model), grads(plain))


def test_the_rule_counts_the_labels_after_the_causal_shift():
    batch = batches(1)[0]
    pieces = scatter((), batch, 4, call="model(**batch)")
    labels = [k["labels"] for _, k in pieces]
    weights = loss_weights(pieces, shift=True)
    counts = [int((y[:, 1:] != -100).sum()) for y in labels]
    assert weights.kind == "tokens"
    assert weights.weights == [c / sum(counts) for c in counts]
    assert len(set(counts)) > 1  # the micro-batches hold different numbers of label tokens
    unshifted = loss_weights(pieces, shift=False).weights
    assert unshifted == [int((y != -100).sum()) / int((batch["labels"] != -100).sum()) for y in labels]


def test_hf_causal_models_shift_and_encoder_decoders_do_not():
    assert shifts_labels(gpt2()) and shifts_labels(llama())
    assert shifts_labels(pipeline_of(gpt2(), "transformer.h"))
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    )
    assert not shifts_labels(t5)
    assert not shifts_labels(nn.Linear(2, 2))


def test_a_sum_reduced_loss_is_added_up_exactly():
    """HF's num_items_in_batch makes the loss a sum over tokens divided by a fixed number: the
    micro-batches' values add up to the whole batch's, and its gradients are the whole batch's."""
    batch = batches(1)[0]
    items = int((batch["labels"][:, 1:] != -100).sum())
    torch.manual_seed(0)
    plain = gpt2()
    want = plain(**batch, num_items_in_batch=items).loss
    want.backward()
    model = routed("gpt2")
    got = model(**batch, num_items_in_batch=items).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert_close(grads(model), grads(plain))
    values = [torch.tensor(0.1), torch.tensor(0.2), torch.tensor(0.3)]
    pieces = [((), {"x": torch.zeros(1), "num_items_in_batch": items})] * 3
    joined = gather(
        [{"loss": v} for v in values], call="m", weights=lambda: loss_weights(pieces, shift=False)
    )
    assert joined["loss"].item() == (values[0] + values[1] + values[2]).item()


class _MeanOfSquares(nn.Module):
    """A model whose forward returns a 0-dim mean that no keyword describes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return (x**2).mean()


def test_a_scalar_the_call_does_not_describe_is_warned_and_taken_as_a_sample_mean():
    from pipeckpt.engines.local.module import ModuleRunner
    from pipeckpt.stages.partition import plan

    torch.manual_seed(0)
    model = _MeanOfSquares()
    x = torch.randn(8, 4)
    want = model(x)
    spec = pipeline_of(model, "layers")
    ModuleRunner(spec, plan(spec, devices=[torch.device("cpu")], stages=2, chunks=4), chunks=4)
    with pytest.warns(PipeckptWarning, match="combined as a mean over samples"):
        got = model(x)
    torch.testing.assert_close(got, want)  # a mean over samples: exact here


def test_the_batch_comes_from_the_first_keyword_tensor_with_a_dimension():
    ids, scale = torch.zeros(6, 3), torch.tensor(2.0)
    assert batch_size((), call="m", kwargs={"scale": scale, "input_ids": ids}) == 6
    pieces = scatter((), {"scale": scale, "input_ids": ids, "labels": torch.ones(6, 3)}, 3, call="m")
    assert [a for a, _ in pieces] == [(), (), ()]
    assert all(k["scale"] is scale and k["input_ids"].shape == (2, 3) for _, k in pieces)
    assert [tuple(k["labels"].shape) for _, k in pieces] == [(2, 3)] * 3


def test_a_call_with_no_tensor_at_all_is_refused_with_the_rule():
    with pytest.raises(pipeckpt.PipeckptConfigError, match="first keyword tensor"):
        scatter((), {"n": 3}, 2, call="m")
