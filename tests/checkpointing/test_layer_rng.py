"""Per-layer random streams (``checkpointing.layer_rng``, the ``layer_rng`` setting): dropout masks that
depend on the seed, the training call, the micro-batch and the layer, never on the layout.

Most tests build the local engine on the toy module without a Trainer (it is cheap) and take one or
two training calls' gradients; a few train through Lightning to check the checkpointed state."""

from typing import Any, Dict, List

import pytest
import torch
from support.toy import ToyModule, assert_bitwise_equal, fit, max_relative_difference, params
from torch import Tensor, nn

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt.boundaries.pipeline_of import pipeline_of
from pipeckpt.checkpointing.layer_rng import LayerStreams
from pipeckpt.engines.local import LocalEngine
from pipeckpt.settings import PipeSettings

CPU = [torch.device("cpu")]
LAYOUTS = {1: [6], 2: [3, 3], 4: [1, 2, 2, 1]}
MODES = ["never", "except_last", "always", "offload"]


def built(*, dropout: float = 0.3, seed: int = 123, **settings: Any) -> LocalEngine:
    """The local engine built on a toy module, as the strategy builds it (no Trainer)."""
    module = ToyModule(dropout=dropout)
    engine = LocalEngine(PipeSettings(chunks=4, **settings))
    torch.manual_seed(seed)  # the streams' seed: torch.initial_seed() when built
    engine.build(module, module.layers, CPU)
    return engine


def batch(step: int) -> Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + step))


def gradients(engine: LocalEngine, calls: int = 2) -> Dict[str, Tensor]:
    """The gradients summed over ``calls`` training calls of the pipeline."""
    assert engine.sequential is not None
    for step in range(calls):
        engine.sequential(batch(step)).pow(2).mean().backward()
    return {k: p.grad.clone() for k, p in engine.sequential.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stages", [2, 4])
def test_dropout_gradients_are_bitwise_equal_across_stage_counts_and_modes(stages, mode):
    reference = gradients(built(balance=LAYOUTS[1], checkpoint="never"))
    assert_bitwise_equal(gradients(built(balance=LAYOUTS[stages], checkpoint=mode)), reference)


def test_without_layer_streams_the_masks_follow_the_layout():
    # The same comparison with layer_rng='off' fails: the test above can fail.
    one = gradients(built(balance=LAYOUTS[1], checkpoint="never", layer_rng="off"))
    two = gradients(built(balance=LAYOUTS[2], checkpoint="never", layer_rng="off"))
    assert max_relative_difference(two, one) > 1e-3


def test_dropout_is_on_and_masks_change_with_the_seed():
    with_dropout = gradients(built(balance=LAYOUTS[2]))
    assert max_relative_difference(with_dropout, gradients(built(balance=LAYOUTS[2], dropout=0.0))) > 1e-3
    assert max_relative_difference(with_dropout, gradients(built(balance=LAYOUTS[2], seed=7))) > 1e-3


def test_each_microbatch_layer_and_call_draws_its_own_mask():
    seen: List[Tensor] = []
    engine = built(balance=LAYOUTS[2], checkpoint="never")
    assert engine.sequential is not None
    for layer in list(engine.sequential)[1:-1]:  # the blocks holding a Dropout
        layer[1].register_forward_hook(lambda m, i, o: seen.append(o.ne(0).flatten().clone()))
    with torch.no_grad():
        engine.sequential(batch(0))
        engine.sequential(batch(0))
    # 2 calls x 4 micro-batches x 4 dropout layers, all masks different
    assert len(seen) == 32
    assert len({tuple(m.tolist()) for m in seen}) == 32


def test_the_callers_generator_is_untouched_by_the_layers():
    engine = built(balance=LAYOUTS[2], checkpoint="always")
    assert engine.sequential is not None
    before = torch.get_rng_state()
    engine.sequential(batch(0)).sum().backward()
    assert torch.equal(torch.get_rng_state(), before)


def test_with_layer_rng_off_the_layers_draw_from_the_callers_generator():
    engine = built(balance=LAYOUTS[2], layer_rng="off")
    assert engine.sequential is not None
    before = torch.get_rng_state()
    engine.sequential(batch(0))
    assert not torch.equal(torch.get_rng_state(), before)


class Noise(nn.Module):
    """Draws random numbers in its own code, with no random module inside."""

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.rand_like(x) if self.training else x


def test_auto_keeps_seeding_the_layers_that_drew_at_their_first_training_call_and_all_every_layer():
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Linear(4, 4), nn.Sequential(nn.Dropout(0.1)), Noise(), nn.MultiheadAttention(4, 1), nn.Dropout(0.0)
    )
    x = torch.randn(2, 3, 4)
    for scope, expected in [("auto", [1, 2]), ("all", [0, 1, 2, 3, 4]), ("off", [])]:
        streams = LayerStreams(scope)
        streams.start(0)
        streams.attach(list(layers), CPU * 5)
        streams.next_call()
        with streams.microbatch(0):
            for layer in layers:
                layer(x, x, x) if isinstance(layer, nn.MultiheadAttention) else layer(x)
        # MultiheadAttention and Dropout with p=0 draw nothing, so auto runs them as they are
        assert [list(layers).index(m) for m in streams.drawing_layers] == expected, scope
        streams.detach()


def test_layers_released_to_other_processes_run_as_they_are_and_need_no_key_once_the_rest_are_known():
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])  # none draws
    streams = LayerStreams("auto")
    streams.start(0)
    streams.attach(list(layers), CPU * 4)
    streams.release(list(layers[2:]))  # another rank's half of a distributed pipeline
    assert all("forward" not in m.__dict__ for m in layers[2:])
    assert streams.seeded_layers == list(layers[:2])
    streams.next_call()
    with streams.microbatch(0):
        assert streams.current() is not None  # this process's layers are not known yet
        layers[:2](torch.randn(2, 4))
    with streams.microbatch(1):
        assert streams.current() is None  # both known not to draw: no key is entered
    assert all("forward" not in m.__dict__ for m in layers)


@pytest.mark.parametrize("scope", ["auto", "all"])
def test_a_layer_that_draws_in_its_own_code_gets_a_stream_of_its_own(scope):
    def noisy(balance: List[int], scope: str, caller_seed: int) -> Tensor:
        torch.manual_seed(0)
        module = ToyModule()
        module.layers = nn.Sequential(*module.layers[:3], Noise(), *module.layers[3:])
        engine = LocalEngine(PipeSettings(chunks=4, balance=balance, layer_rng=scope))
        engine.build(module, module.layers, CPU)
        torch.manual_seed(caller_seed)
        return module.layers(batch(0)).detach()

    assert torch.equal(noisy([7], scope, caller_seed=1), noisy([2, 3, 2], scope, caller_seed=2))
    # off: Noise draws from the caller's generator
    assert not torch.equal(noisy([7], "off", caller_seed=1), noisy([7], "off", caller_seed=2))


def test_layers_in_eval_mode_draw_nothing_and_keep_no_call_count():
    engine = built(balance=LAYOUTS[2])
    assert engine.sequential is not None
    engine.sequential.eval()
    out = engine.sequential(batch(0))
    assert engine.layer_rng.calls == 0
    engine.sequential.train()
    assert torch.equal(out, engine.sequential.eval()(batch(0)))  # no dropout in eval


def test_teardown_gives_the_layers_their_own_forward_back():
    engine = built(balance=LAYOUTS[2])
    module = engine.module
    assert module is not None
    wrapped = engine.layer_rng.seeded_layers
    assert len(wrapped) == 6 and all("forward" in m.__dict__ for m in wrapped)
    engine.teardown(module)
    assert all("forward" not in m.__dict__ for m in module.layers)


class Blocks(nn.Module):
    """A module with its own forward over a ModuleList (``pipeline_of``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Tanh()) for _ in range(4))
        self.drop = nn.Dropout(0.2)  # outside the layers: the caller's generator, in micro-batch order

    def forward(self, x: Tensor) -> Tensor:
        x = self.drop(self.inp(x))
        for block in self.h:
            x = block(x)
        return x


class BlocksModule(ToyModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Blocks()

    def configure_pipeline(self) -> Any:
        return pipeline_of(self.model, "h")


@pytest.mark.parametrize("balance, mode", [([2, 2], "never"), ([1, 1, 2], "always"), ([1, 3], "except_last")])
def test_pipeline_of_draws_the_same_masks_under_every_layout(balance, mode):
    def grads(balance: List[int], mode: str) -> Dict[str, Tensor]:
        module = BlocksModule()
        engine = LocalEngine(PipeSettings(chunks=4, balance=balance, checkpoint=mode))
        torch.manual_seed(5)
        engine.build(module, module.configure_pipeline(), CPU)
        for step in range(2):
            module.model(batch(step)).pow(2).mean().backward()
        return {k: p.grad.clone() for k, p in module.model.named_parameters()}

    assert_bitwise_equal(grads(balance, mode), grads([4], "never"))


def test_an_unknown_layer_rng_is_refused_with_the_choices():
    with pytest.raises(PipeckptConfigError, match=r"layer_rng='sometimes'.*'auto', 'all', 'off'.*HINT"):
        PipelineStrategy(layer_rng="sometimes")


# -- through Lightning: the checkpoint keeps the streams ----------------------------------


def test_training_with_dropout_ends_bitwise_equal_under_1_and_4_stages():
    one = params(fit(ToyModule(dropout=0.3), PipelineStrategy(stages=1, chunks=4), steps=3).lightning_module)
    four = fit(
        ToyModule(dropout=0.3), PipelineStrategy(balance=[1, 2, 2, 1], chunks=4, checkpoint="always"), steps=3
    )
    assert_bitwise_equal(params(four.lightning_module), one)


def test_the_checkpoint_holds_the_seed_and_the_count_of_training_calls(tmp_path):
    trainer = fit(ToyModule(dropout=0.3), PipelineStrategy(balance=[3, 3], chunks=4), steps=3, seed=321)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    state = torch.load(tmp_path / "a.ckpt", weights_only=True)["pipeckpt"]["layer_rng"]
    assert state == {"seed": 321, "calls": 3}
