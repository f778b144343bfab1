"""Under ``tensor_parallel`` the distributed engine splits a ``pipeline_of`` model's LM head over the
vocabulary and runs the model's own loss on its vocabulary-sharded logits under torch's
``loss_parallel`` (engines/distributed/vocab_plan.py, vocab_loss.py): each rank holds ``1/tp`` of
every tensor shaped by the vocabulary. The memory model counts the last stage's logits so
(memory/vocab_share.py), found by their shapes. HF Llama (vocabulary 4096, hidden 48, 4 layers,
untied head) on one micro-batch of 2 x 16 token ids, 2 stages of 2 layers, GPipe, ``never``, SGD;
the expected figures by hand from the shapes."""

from dataclasses import replace
from typing import Tuple

import pytest
import torch
import transformers as hf
from torch import nn

from pipeckpt import pipeline_of
from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.engines.distributed.tensor_parallel import layer_plan
from pipeckpt.memory.budget import resolve_auto
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import ModelProfile, profile
from pipeckpt.memory.rooted import RootInput
from pipeckpt.memory.sharding import Layout
from pipeckpt.memory.vocab_share import split_over_vocabulary
from pipeckpt.memory.walk import StageMemory
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.partition import StagePlan

pytestmark = pytest.mark.usefixtures("one_thread")

B, S, V, HIDDEN = 2, 16, 4096, 48
LOGITS = B * S * V * 4  # one fp32 tensor of micro-batch x sequence x vocabulary: 524,288 bytes
CPU = torch.device("cpu")
PLAN = StagePlan(balance=(2, 2), devices=(CPU, CPU), modes=parse_modes("never", 2))


def _llama(tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = hf.LlamaConfig(
        vocab_size=V, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, use_cache=False, tie_word_embeddings=tied,
    )  # fmt: skip
    return hf.LlamaForCausalLM(config)


def _call() -> RootInput:
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    return RootInput((), dict(input_ids=ids, labels=ids))


def _profiled(model: nn.Module) -> Tuple[ModelProfile, Tuple[Tuple[str, str], ...]]:
    """The model's profile, and the plan the engine applies under ``tensor_parallel=2`` (the model's
    own: its layers' projections, and the embedding and head over the vocabulary where untied)."""
    spec = pipeline_of(model, "model.layers")
    fitted = profile(spec, _call(), rounds=1)
    settings = PipeSettings(engine="distributed", tensor_parallel=2, data_parallel="fsdp")
    plan = layer_plan(spec, settings).tensor_parallel_plan
    assert plan is not None
    return fitted, tuple(plan.items())


@pytest.fixture(scope="module")
def untied() -> Tuple[ModelProfile, Tuple[Tuple[str, str], ...]]:
    return _profiled(_llama())


def _last_stage(fitted: ModelProfile) -> StageMemory:
    return predict(fitted, PLAN, chunks=1, optimizer="sgd", schedule="gpipe").stages[1]


def test_the_outside_pass_finds_the_head_by_its_output_features(untied) -> None:
    outside = untied[0].outside
    assert (outside.head, outside.head_shape) == ("lm_head", (V, HIDDEN))


def test_under_tp2_the_loss_saves_half_of_the_log_probabilities(untied) -> None:
    whole, plan = untied
    split = split_over_vocabulary(whole, 2, plan)
    saved = set(whole.loss.saved)
    # cross-entropy saves its log-probabilities, (B * S) x V fp32: half of them on each rank
    assert whole.bytes_of(saved) - split.bytes_of(saved) == LOGITS // 2


def test_under_tp2_the_last_stages_peak_holds_five_half_logits_tensors_where_whole_it_holds_four(
    untied,
) -> None:
    whole, plan = untied
    before, after = _last_stage(whole), _last_stage(split_over_vocabulary(whole, 2, plan))
    # At its peak, the head's backward, the last stage holds the log-probabilities the loss saved and
    # the logits (torch's PipelineStage keeps the micro-batch's output until its backward); beside
    # them aten's ops hold the gradients of the log-probabilities and of the logits, where
    # loss_parallel's NLL backward holds a zeroed tensor, an exp's sum with it and their product, each
    # half on a rank (memory/loss_parallel_bytes.py). Within 1 KiB: the two peaks fall at different
    # ops of the backward, beside different scalars of the loss.
    assert (before.peak_at, after.peak_at) == ("B0 loss", "B0 loss")
    assert before.peak - after.peak == pytest.approx(4 * LOGITS - 5 * LOGITS // 2, abs=1024)


def test_the_last_stage_keeps_each_micro_batchs_logits_and_loss_until_its_backward(untied) -> None:
    whole, _ = untied
    outputs = [whole.storage_shapes[i] for i in whole.loss.outputs]
    assert sorted(outputs) == [(), (B * S, V)]  # the loss, and the logits (first seen flattened)
    unkept = replace(whole, loss=replace(whole.loss, outputs=()))
    before, after = _last_stage(unkept), _last_stage(whole)
    assert (before.peak_at, after.peak_at) == ("B0 loss", "B0 loss")
    assert after.peak - before.peak == LOGITS + 4  # the logits and the fp32 loss


def test_under_tp2_the_first_stage_is_unchanged(untied) -> None:
    whole, plan = untied
    before, after = (
        predict(p, PLAN, chunks=1, optimizer="sgd", schedule="gpipe").stages[0]
        for p in (whole, split_over_vocabulary(whole, 2, plan))
    )
    assert after == before


def test_at_tp1_the_profile_is_left_as_it_is(untied) -> None:
    whole, plan = untied
    assert split_over_vocabulary(whole, 1, plan) is whole


def test_a_head_the_plan_does_not_split_keeps_its_logits_whole(untied) -> None:
    whole, plan = untied
    layers_only = tuple((k, v) for k, v in plan if k != "lm_head")
    assert split_over_vocabulary(whole, 2, layers_only) is whole


def test_a_tied_head_keeps_its_logits_whole_under_the_engines_own_plan() -> None:
    whole, plan = _profiled(_llama(tied=True))
    assert "lm_head" not in dict(plan)  # the engine leaves a tied head whole
    assert split_over_vocabulary(whole, 2, plan) is whole


def test_the_loss_links_forward_peak_counts_its_logits_not_the_weights_outside_the_layers(untied) -> None:
    # The logits and their log-probabilities, within 2% (the hidden states and the loss's small
    # tensors); the embedding's and the head's weights (V x 48 fp32 each), held before the forward,
    # are not made by it.
    assert untied[0].loss.forward_peak == pytest.approx(2 * LOGITS, rel=0.02)


def test_auto_under_a_layout_that_splits_the_head_walks_each_ranks_share_of_the_logits(untied) -> None:
    whole, plan = untied
    settings = PipeSettings(
        engine="distributed", checkpoint="auto", memory_budget="1GiB", balance=[2, 2], chunks=1,
        schedule="gpipe", memory_optimizer="sgd", data_parallel="fsdp", tensor_parallel=2,
    )  # fmt: skip
    spec = pipeline_of(_llama(), "model.layers")
    layout = Layout(tp=2, tp_plan=plan)
    chosen = resolve_auto(settings, spec, devices=[CPU], batch=_call(), profiles={1: whole}, layout=layout)
    assert chosen.choice.modes[1].name == "never"
    last, split = chosen.choice.prediction.stages[1], _last_stage(split_over_vocabulary(whole, 2, plan))
    assert (last.activations, last.working, last.peak_at) == (split.activations, split.working, split.peak_at)
