"""What a split backward's input pass keeps for its weight pass, as the profile measures it per layer
(memory/memory_pass.py ``_split_held``) and a zero-bubble stage holds it between the two passes
(memory/stage_model.py ``between_passes``): the gradient recorded where each weight joins the input's
path (stages/weight_pass.py), every linear's output and a norm's, not one per layer output."""

import dataclasses

import pytest
import torch
from support.hf_models import BATCH, LENGTH, batches, llama
from torch import nn

from pipeckpt import pipeline_of
from pipeckpt.checkpointing.modes import parse_mode
from pipeckpt.memory import memory_pass
from pipeckpt.memory.budget import resolve_auto
from pipeckpt.memory.profile import profile
from pipeckpt.memory.rooted import RootInput
from pipeckpt.memory.stage_model import _StageModel, between_passes
from pipeckpt.settings import PipeSettings

_SPLIT_FIELDS = ("split_held", "split_whole", "weight_pass_peak")
_TIMES = ("forward_s", "backward_s", "sac_s", "sac_extra_s")


def _llama_profile():
    torch.manual_seed(0)
    model = llama()
    return model, profile(pipeline_of(model, "model.layers"), RootInput((), batches(1)[0]), rounds=1)


def test_an_hf_llama_layers_input_pass_keeps_every_linears_and_norms_output_gradient() -> None:
    model, fitted = _llama_profile()
    block = model.model.layers[0]
    features = sum(m.out_features for m in block.modules() if isinstance(m, nn.Linear))
    features += 2 * model.config.hidden_size  # its two RMSNorms' weights join at their outputs
    expected = BATCH * LENGTH * features * 4  # float32 gradients, one per output element
    assert [layer.split_held for layer in fitted.layers] == [expected] * len(model.model.layers)
    # which is 11x the layer's output here (hidden 32, intermediate 64, 2 heads of 16)
    assert expected == 11 * fitted.bytes_of(set(fitted.layers[0].outputs))


def test_a_first_layer_whose_input_needs_no_gradient_is_measured_as_deferring_the_whole_backward() -> None:
    seq = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    fitted = profile(seq, torch.randint(0, 10, (4, 5)), rounds=1)
    assert [layer.split_whole for layer in fitted.layers] == [True, False, False]
    assert fitted.layers[1].split_held == 4 * 5 * 8 * 4  # the linear's output gradient


def test_a_stage_holds_its_layers_measured_gradients_between_its_passes() -> None:
    _, fitted = _llama_profile()
    stage = _StageModel(fitted, 1, 3, first=False, last=False, local=False)
    saved = stage.bytes(fitted.saved_union(1, 3))
    held = fitted.layers[1].split_held + fitted.layers[2].split_held
    assert between_passes(stage, parse_mode("never")) == saved + held


def test_a_stage_begun_by_a_layer_without_an_input_gradient_holds_only_its_outputs_gradient() -> None:
    seq = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    fitted = profile(seq, torch.randint(0, 10, (4, 5)), rounds=1)
    stage = _StageModel(fitted, 0, 3, first=True, last=False, local=False)
    saved = stage.bytes(fitted.saved_union(0, 3))
    assert between_passes(stage, parse_mode("always")) == saved + 4 * 5 * 3 * 4


def test_a_selective_stage_holds_nothing_between_passes() -> None:
    _, fitted = _llama_profile()
    stage = _StageModel(fitted, 0, 2, first=False, last=False, local=False)
    assert between_passes(stage, parse_mode("selective")) == 0


def test_an_hf_llama_layers_weight_pass_holds_at_most_one_norm_sized_temporary_above_its_start() -> None:
    model, fitted = _llama_profile()
    # RMSNorm's weight gradient is its output gradient times the normalised input, summed over the
    # tokens: the product and its sum are the pass's most at once, as it frees what the input pass
    # recorded (each linear's weight gradient, 32 x 32 or 32 x 64, is smaller than the product)
    hidden = model.config.hidden_size
    norm_product, its_sum = BATCH * LENGTH * hidden * 4, hidden * 4
    expected = norm_product + its_sum
    assert [layer.weight_pass_peak for layer in fitted.layers] == [expected] * len(model.model.layers)
    assert expected < fitted.layers[0].backward_peak


def test_a_profile_told_no_schedule_splits_skips_the_split_and_measures_the_rest_the_same() -> None:
    _, split = _llama_profile()
    torch.manual_seed(0)
    whole = profile(
        pipeline_of(llama(), "model.layers"), RootInput((), batches(1)[0]), rounds=1, split_backward=False
    )
    assert [(layer.split_held, layer.weight_pass_peak) for layer in whole.layers] == [(None, None)] * 4
    assert dataclasses.replace(whole, layers=(), loss=None) == dataclasses.replace(
        split, layers=(), loss=None
    )
    for a, b in zip(whole.layers, split.layers):
        skipped = {f: None for f in (*_SPLIT_FIELDS, *_TIMES)}
        assert dataclasses.replace(a, **skipped) == dataclasses.replace(b, **skipped)


def test_auto_profiles_without_the_split_its_schedules_never_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_: object) -> None:
        raise AssertionError("the split pass ran")

    monkeypatch.setattr(memory_pass, "_split_held", refused)
    torch.manual_seed(0)
    settings = PipeSettings(engine="distributed", stages=2, chunks=2, checkpoint="auto", memory_budget="1GiB")
    sequential = pipeline_of(llama(), "model.layers")
    auto = resolve_auto(
        settings, sequential, devices=[torch.device("cpu")] * 2, batch=RootInput((), batches(1)[0])
    )
    assert len(auto.choice.modes) == 2
