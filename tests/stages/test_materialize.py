"""A module built on the meta device, made real layer by layer (pipeckpt/stages/materialize.py):
the layers a process keeps get exactly the values an eager build with the same seed gives them,
the others stay on meta, the generator ends where the eager build left it, and a layer that cannot
initialise itself is refused by its own name before anything is drawn."""

import pytest
import torch
from support.toy import ToyModule, assert_bitwise_equal
from torch import nn

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.engines.distributed.agreed_plan import agreed_plan
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.materialize import claim_build, materialize, on_meta, remember_build

SEED = 7
CPU = torch.device("cpu")


def _layers() -> nn.Sequential:
    # Built in the order the layers are registered, as the rule asks.
    layers: list = [nn.Embedding(50, 16)]
    layers += [nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU()) for _ in range(3)]
    return nn.Sequential(*layers, nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Conv1d(3, 4, 3))


def _eager_and_meta() -> tuple:
    torch.manual_seed(SEED)
    eager = _layers()
    after = torch.get_rng_state()
    with torch.device("meta"):
        meta = _layers()
    torch.manual_seed(SEED)
    return eager, meta, after


def test_kept_layers_get_the_eager_builds_values_others_stay_on_meta_and_the_generator_ends_alike():
    eager, meta, after = _eager_and_meta()
    kept = {id(t) for i in (2, 5) for t in (*meta[i].parameters(), *meta[i].buffers())}
    materialize(meta, CPU, keep=lambda t: id(t) in kept)
    for (name, want), got in zip(eager.state_dict().items(), meta.state_dict().values()):
        if name.startswith(("2.", "5.")):
            assert torch.equal(got, want), name
        else:
            assert got.is_meta, name
    assert torch.equal(torch.get_rng_state(), after)


def test_with_agree_drawing_stops_after_the_last_kept_layer_and_the_generator_takes_the_agreed_end():
    eager, meta, after = _eager_and_meta()
    kept = {id(t) for t in meta[1].parameters()}
    told = []

    def agree(mine):  # what a process that drew every layer (here: the eager build) tells the others
        told.append(mine)
        return (after, None)

    materialize(meta, CPU, keep=lambda t: id(t) in kept, agree=agree)
    assert told == [None]  # this process stopped early
    assert_bitwise_equal(meta[1].state_dict(), eager[1].state_dict())
    assert torch.equal(torch.get_rng_state(), after)


def test_every_layer_made_real_equals_the_eager_build():
    eager, meta, _ = _eager_and_meta()
    materialize(meta, CPU)
    assert not on_meta(meta)
    for (name, want), got in zip(eager.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(got, want), name


class Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_a_layer_without_reset_parameters_is_refused_by_its_own_name():
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Gain()))
    with pytest.raises(PipeckptConfigError) as error:
        materialize(meta, CPU, name="self.layers")
    message = str(error.value)
    assert "self.layers.1.0 (Gain, holding gain)" in message
    assert "reset_parameters()" in message and "HINT: give Gain a reset_parameters()" in message
    assert on_meta(meta[0])  # refused before any layer was made real


class HalfReset(Gain):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.gain)  # forgets the bias


def test_a_reset_parameters_that_leaves_a_tensor_unset_is_refused():
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), HalfReset())
    unset = r"self\.1\.reset_parameters\(\) \(HalfReset\) left bias unset"
    with pytest.raises(PipeckptConfigError, match=unset):
        materialize(meta, CPU)


def test_a_shared_parameter_keeps_one_storage_and_the_first_layers_values():
    def tied() -> nn.Sequential:
        layers = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        layers[1].weight = layers[0].weight
        return layers

    torch.manual_seed(SEED)
    embedding_first = nn.Embedding(10, 4).weight.detach().clone()
    with torch.device("meta"):
        meta = tied()
    torch.manual_seed(SEED)
    materialize(meta, CPU)
    assert meta[1].weight is meta[0].weight
    assert torch.equal(meta[0].weight, embedding_first)


def _hf(name: str) -> nn.Module:
    from support.hf_models import gpt2, llama
    from support.pretrained_models import config

    if name == "qwen2":
        import transformers

        return transformers.Qwen2ForCausalLM(config("qwen2"))
    return {"gpt2": gpt2, "llama": llama}[name]()


def _among(ids: set):
    return lambda t: id(t) in ids


def _hf_layers(model: nn.Module) -> nn.Module:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_hugging_face_model_built_on_meta_equals_the_eager_build_bitwise_whole_or_in_part(name):
    torch.manual_seed(SEED)
    eager = _hf(name)
    after = torch.get_rng_state()
    for keep_from in (0, 2):  # the whole model; the last two layers only
        torch.manual_seed(SEED)
        with torch.device("meta"):
            meta = _hf(name)
        kept = {
            id(t)
            for t in (*_hf_layers(meta)[keep_from:].parameters(), *_hf_layers(meta)[keep_from:].buffers())
        }
        materialize(meta, CPU, keep=None if keep_from == 0 else _among(kept))
        real = {k: v for k, v in meta.state_dict().items() if not v.is_meta}
        layers = {f"{i}." for i in range(keep_from, len(_hf_layers(eager)))}
        held_here = [k for k in eager.state_dict() if keep_from == 0 or k.split("layers.")[-1][:2] in layers]
        assert sorted(real) == sorted(held_here)
        assert_bitwise_equal(real, {k: v for k, v in eager.state_dict().items() if k in real})
        assert torch.equal(torch.get_rng_state(), after)
        if keep_from == 0:  # the rotary frequencies, from the model's own code
            assert_bitwise_equal(dict(meta.named_buffers()), dict(eager.named_buffers()))


def test_gpt2_built_on_meta_gets_hf_initialisation_the_same_in_every_layout():
    # Conv1D draws in its constructor without a reset_parameters(), which a meta build cannot replay:
    # the values then differ from an eager build's, but not between layouts.
    torch.manual_seed(SEED)
    with torch.device("meta"):
        whole = _hf("gpt2")
    materialize(whole, CPU)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        part = _hf("gpt2")
    kept = {id(t) for t in _hf_layers(part)[1:3].parameters()}
    materialize(part, CPU, keep=lambda t: id(t) in kept)
    real = {k: v for k, v in part.state_dict().items() if not v.is_meta}
    assert_bitwise_equal(real, {k: v for k, v in whole.state_dict().items() if k in real})
    assert whole.lm_head.weight is whole.transformer.wte.weight
    block = whole.transformer.h[0]
    assert torch.equal(block.attn.c_attn.bias, torch.zeros_like(block.attn.c_attn.bias))
    assert torch.equal(block.ln_1.weight, torch.ones_like(block.ln_1.weight))
    scaled = 0.02 / (2 * whole.config.n_layer) ** 0.5  # GPT-2's residual projections
    assert abs(block.attn.c_proj.weight.std().item() - scaled) < 0.2 * scaled
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.1 * 0.02


def test_a_tensor_in_a_hugging_face_model_its_init_leaves_unset_is_refused_by_name():
    class Gain(nn.Module):  # neither reset_parameters() nor a case of HF's _init_weights
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = _hf("llama")
        model.model.layers[1].gain = Gain()
    with pytest.raises(
        PipeckptConfigError, match=r"self\.model\.layers\.1\.gain\.gain \(Gain\) is left unset"
    ):
        materialize(model, CPU)


def test_a_profiled_balance_of_a_module_on_meta_is_refused_before_any_process_talks():
    with torch.device("meta"):
        module = ToyModule()
    remember_build(CPU)  # as the strategy's configure_model context notes a build, and its set-up claims it
    claim_build(module)
    settings = PipeSettings(engine="distributed", balance_by="time", stages=2)
    with pytest.raises(PipeckptConfigError, match="balance_by='time' with a module built on the meta device"):
        agreed_plan(module, module.layers, settings, stages=2, device=CPU)


def test_a_meta_build_no_set_up_claimed_leaves_another_modules_values_alone():
    torch.manual_seed(123)
    remember_build(CPU)  # a module built on meta whose fit never reached set-up
    eager, meta, _ = _eager_and_meta()
    materialize(meta, CPU)
    assert_bitwise_equal(meta.state_dict(), eager.state_dict())
