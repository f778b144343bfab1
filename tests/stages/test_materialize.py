"""A module built on the meta device, made real layer by layer (pipeckpt/stages/materialize.py):
the layers a process keeps get exactly the values an eager build with the same seed gives them,
the others stay on meta, the generator ends where the eager build left it, and a layer that cannot
initialise itself is refused by its own name before anything is drawn."""

import pytest
import torch
from support.toy import ToyModule, assert_bitwise_equal
from torch import nn

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.engines.distributed.wiring import agreed_plan
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


def test_a_hugging_face_model_is_refused_naming_its_first_layer_without_reset_parameters():
    from support.hf_models import gpt2

    with torch.device("meta"):
        model = gpt2()
    with pytest.raises(PipeckptConfigError, match=r"self\.transformer\.h\.0\.attn\.c_attn \(Conv1D"):
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
