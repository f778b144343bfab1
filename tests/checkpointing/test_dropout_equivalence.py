"""The local engine against the unpipelined module with dropout on (and the
``pipeline_of`` clients): pytrees and side inputs (1, 2), skip connections across stages (3), a
weight shared by the first and last stage (4), and Hugging Face GPT-2 / Lightning's demo Transformer.

Two references, both the plain module's own code with no pipeline, stage or checkpoint:

- ``layer_rng='off'`` and one micro-batch: every layer draws from the caller's generator in the
  module's own order, so the pipelined gradients must equal those of the plain module called once on
  the whole batch, its masks drawn as PyTorch draws them;
- the default per-layer streams and 4 micro-batches: the plain module called on each micro-batch in
  turn, each named layer seeded by a :class:`~pipeckpt.checkpointing.layer_rng.LayerStreams` of its own (the
  documented stream of layer ``k``, micro-batch ``m``), the outputs joined, the same loss taken. This is
  the reference the distributed engine is held against
  (tests/engines/distributed/test_distributed_equivalence.py: one local
  stage), here shown equal to the unpipelined module.

Tolerance 1e-5 absolute on gradients (the pipeline sums micro-batch gradients in another order);
across checkpoint modes gradients are bitwise equal (on CPU).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from support.equivalence_models import Skips, TiedDropoutModule, plain_pytree, pytree_mask
from support.pytree_models import VOCAB, pytree_layers
from support.real_models import example
from torch import Tensor, nn

from pipeckpt import pipeline_of
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.checkpointing.layer_rng import LayerStreams
from pipeckpt.engines.local import LocalEngine
from pipeckpt.settings import PipeSettings

CPU = [torch.device("cpu")]
DROPOUT = 0.3
SEED = 5  # the streams' seed (torch.initial_seed() at build) and the caller's generator's
CHUNKS = 4
MODES = ["never", "except_last", "always", "offload", "mix"]
TOLERANCE = 1e-5


class Holder(L.LightningModule):
    """What the engine is built on: a LightningModule holding the model as ``model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


@dataclass
class Case:
    """One model: ``make()`` -> (model, what the pipeline is built on); ``call(f, batch)`` -> the
    output of ``f`` (the pipelined Sequential, or the model whose layers ``pipeline_of`` routes) on
    ``batch``; ``plain(model, batch)`` -> the unpipelined output; ``loss(output, batch)``; ``join``
    joins micro-batch outputs in sample order."""

    make: Callable[[], Tuple[nn.Module, Any]]
    call: Callable[[Any, Any], Any]
    plain: Callable[[nn.Module, Any], Any]
    loss: Callable[[Any, Any], Tensor]
    batch: Callable[[], Tuple[Tensor, ...]]
    balance: List[int]
    join: Callable[[List[Any]], Any] = lambda outs: torch.cat(outs)


# -- the models ---------------------------------------------------------------------------


def _pytree_batch() -> Tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _pytree() -> Tuple[nn.Module, Any]:
    torch.manual_seed(0)
    layers = pytree_layers(dropout=DROPOUT)
    return layers, layers


def _tied() -> Tuple[nn.Module, Any]:
    layers = TiedDropoutModule(dropout=DROPOUT).layers
    return layers, layers


def _tokens() -> Tuple[Tensor, ...]:
    tokens = torch.randint(0, VOCAB, (16, 5), generator=torch.Generator().manual_seed(2))
    return tokens, tokens.roll(-1, dims=1)


def _skips() -> Tuple[nn.Module, Any]:
    model = Skips(dropout=DROPOUT)
    return model, pipeline_of(model, "blocks")


def _demo() -> Tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = example("demo_transformer_pipeline").DemoModule(dropout=DROPOUT).model
    return model, pipeline_of(model, "transformer.encoder.layers", "transformer.decoder.layers")


def _demo_batch() -> Tuple[Tensor, ...]:
    return next(iter(example("demo_transformer_pipeline").data()))  # 8 samples of 12 tokens


def _gpt2() -> Tuple[nn.Module, Any]:
    ex = example("gpt2_pipeline")
    torch.manual_seed(0)
    model = ex.GPT2LMHeadModel(ex.config(DROPOUT))
    return model, pipeline_of(model, "transformer.h")


def _gpt2_loss(logits: Tensor, batch: Any) -> Tensor:
    ids, mask = batch
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)


CASES: Dict[str, Case] = {
    # items 1 and 2: dicts / tuples with None, ints, strings across every boundary; a side input
    # (mask=) that two layers declare; a tensor made on stage 0 and read on the last (a skip)
    "pytree_side_inputs": Case(
        make=_pytree,
        call=lambda f, b: f(b[0], mask=pytree_mask(b[0])),
        plain=lambda m, b: plain_pytree(m, b[0], pytree_mask(b[0])),
        loss=lambda out, b: F.cross_entropy(out["logits"], b[1]),
        batch=_pytree_batch,
        balance=[1, 2, 2],
        join=lambda outs: {"logits": torch.cat([o["logits"] for o in outs]), "kind": outs[0]["kind"]},
    ),
    # item 3: skips across stages made by the model's own forward (pipeline_of)
    "skips": Case(
        make=_skips,
        call=lambda f, b: f(b[0]),
        plain=lambda m, b: m(b[0]),
        loss=lambda out, b: F.cross_entropy(out, b[1]),
        batch=_pytree_batch,
        balance=[1, 1, 1, 1],
    ),
    # item 3 and 5: the encoder's output read by every decoder layer, dropout outside the layers too
    "demo_transformer": Case(
        make=_demo,
        call=lambda f, b: f(b[0], b[1]),
        plain=lambda m, b: m(b[0], b[1]),
        loss=lambda out, b: F.nll_loss(out, b[1].flatten()),
        batch=_demo_batch,
        balance=[1, 2, 1],
        # join: torch.cat of (micro-batch * length, vocab) outputs, in sample order
    ),
    # item 4: the embedding's weight is the last stage's LM head
    "tied": Case(
        make=_tied,
        call=lambda f, b: f(b[0]),
        plain=lambda m, b: m(b[0]),
        loss=lambda out, b: F.cross_entropy(out.reshape(-1, VOCAB), b[1].reshape(-1)),
        batch=_tokens,
        balance=[2, 1, 2],
    ),
    # items 2, 4 and 5: GPT-2's tied wte / lm_head, its padding mask a side input
    "gpt2": Case(
        make=_gpt2,
        call=lambda f, b: f(b[0], attention_mask=b[1]).logits,
        plain=lambda m, b: m(b[0], attention_mask=b[1]).logits,
        loss=_gpt2_loss,
        batch=lambda: next(iter(example("gpt2_pipeline").data())),
        balance=[1, 2, 1],
    ),
}


@pytest.fixture(params=list(CASES))
def case(request: Any) -> Case:
    if request.param == "gpt2":
        pytest.importorskip("transformers")
    return CASES[request.param]


def _mode(mode: str, stages: int) -> Any:
    return ["always", "never", "except_last", "offload"][:stages] if mode == "mix" else mode


def _grads(model: nn.Module) -> Dict[str, Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _call_pipelined(case: Case, model: nn.Module, built: Any, batch: Any) -> Any:
    if isinstance(built, ModulePipeline):  # pipeline_of: the model's own forward, its layers routed
        return case.call(model, batch)
    return case.call(built, batch)  # a Sequential: the engine's pipeline answers its calls


def pipelined(case: Case, mode: str, *, chunks: int, layer_rng: str) -> Dict[str, Tensor]:
    """Gradients of one training call of the model pipelined by the local engine."""
    model, built = case.make()
    model.train()
    settings = PipeSettings(
        chunks=chunks, balance=case.balance, checkpoint=_mode(mode, len(case.balance)), layer_rng=layer_rng
    )
    engine = LocalEngine(settings)
    torch.manual_seed(SEED)
    engine.build(Holder(model), built, CPU)
    batch = case.batch()
    case.loss(_call_pipelined(case, model, built, batch), batch).backward()
    engine.teardown(None)
    return _grads(model)


def unpipelined_at_once(case: Case) -> Dict[str, Tensor]:
    """The plain model on the whole batch, masks drawn from the caller's generator in its own order."""
    model, _ = case.make()
    model.train()
    torch.manual_seed(SEED)
    batch = case.batch()
    case.loss(case.plain(model, batch), batch).backward()
    return _grads(model)


def _layers(built: Any) -> Sequence[nn.Module]:
    return list(built)  # a Sequential's children, or pipeline_of's named layers, in order


def unpipelined_per_layer_streams(case: Case) -> Dict[str, Tensor]:
    """The plain model on each micro-batch in turn, layer ``k`` seeded per micro-batch by its stream."""
    model, built = case.make()
    model.train()
    streams = LayerStreams("auto")
    torch.manual_seed(SEED)
    streams.start()
    streams.attach(_layers(built), CPU * len(_layers(built)))
    streams.next_call()  # the first training call
    batch = case.batch()
    pieces = list(zip(*(t.chunk(CHUNKS) for t in batch)))
    outputs = []
    for i, piece in enumerate(pieces):
        with streams.microbatch(i):
            outputs.append(case.plain(model, piece))
    streams.detach()
    case.loss(case.join(outputs), batch).backward()
    return _grads(model)


def _assert_close(got: Dict[str, Tensor], expected: Dict[str, Tensor], what: str) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=TOLERANCE, msg=f"{what}: {k}")


@pytest.mark.parametrize("mode", MODES)
def test_one_microbatch_without_layer_streams_matches_the_plain_module_with_its_own_masks(case, mode):
    expected = unpipelined_at_once(case)
    _assert_close(pipelined(case, mode, chunks=1, layer_rng="off"), expected, str(mode))


@pytest.mark.parametrize("mode", MODES)
def test_with_layer_streams_gradients_match_the_plain_module_run_per_microbatch(case, mode):
    expected = unpipelined_per_layer_streams(case)
    _assert_close(pipelined(case, mode, chunks=CHUNKS, layer_rng="auto"), expected, str(mode))


def test_every_mode_gives_gradients_bitwise_equal_to_never(case):
    never = pipelined(case, "never", chunks=CHUNKS, layer_rng="auto")
    for mode in MODES[1:]:
        got = pipelined(case, mode, chunks=CHUNKS, layer_rng="auto")
        for k in never:
            assert torch.equal(got[k], never[k]), f"{mode} {k}"


def test_dropout_is_on_and_the_references_differ(case):
    # The two references draw different masks: were dropout off, or a reference blind to the masks,
    # they would agree, and the tests above would prove nothing about dropout.
    at_once, per_layer = unpipelined_at_once(case), unpipelined_per_layer_streams(case)
    assert max((at_once[k] - per_layer[k]).abs().max().item() for k in at_once) > 1e-3
