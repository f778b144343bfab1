"""A checkpoint of another model, resumed under the distributed engine, is refused with the local
engine's message: the first differing keys and the hyper-parameters to build, with the values the
checkpoint's model was built with; read from the sharded checkpoint's index before any shard."""

from pathlib import Path

import pytest
from lightning.fabric.plugins import TorchCheckpointIO

from pipeckpt import PipeckptCheckpointError
from pipeckpt.app.models import GPT
from pipeckpt.engines.distributed.state import StateIO
from pipeckpt.state import sharded
from pipeckpt.state.fit import check_fits

SMALL = dict(size="tiny", vocab_size=32, seq_len=8, d_model=16, n_heads=2)


@pytest.fixture
def four_layers(tmp_path) -> Path:
    """A sharded checkpoint of a GPT of the tiny size's 4 layers (n_layers left to the size)."""
    module = GPT(**SMALL)
    sharded.save(
        {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "ckpt"
    )
    return tmp_path / "ckpt"


def load_distributed(path: Path, module: GPT) -> dict:
    return StateIO.load(path, module, TorchCheckpointIO(), None)


def test_the_distributed_engine_names_the_differing_hyper_parameters_as_the_local_engine_does(four_layers):
    with pytest.raises(PipeckptCheckpointError) as distributed:
        load_distributed(four_layers, GPT(**SMALL, n_layers=2))
    module = GPT(**SMALL, n_layers=2)
    with pytest.raises(PipeckptCheckpointError) as local:  # the local engine's check, on the whole file
        check_fits(
            module, module.state_dict(), sharded.load(four_layers), strict=True, source=str(four_layers)
        )
    assert str(distributed.value) == str(local.value)
    assert "HINT: build the GPT the checkpoint was written with: n_layers=4 (this model: 2)" in str(
        distributed.value
    )


def test_another_models_shapes_are_named_before_any_shard_is_read(four_layers):
    for shard in four_layers.glob("*.distcp"):
        shard.unlink()
    with pytest.raises(PipeckptCheckpointError) as error:
        load_distributed(four_layers, GPT(**dict(SMALL, d_model=32)))
    assert "in the checkpoint, (32,) in the model" in str(error.value)
    assert "d_model=16 (this model: 32)" in str(error.value)


def test_a_non_strict_module_loads_the_keys_the_checkpoint_holds(four_layers):
    module = GPT(**SMALL, n_layers=6)
    module.strict_loading = False
    state = load_distributed(four_layers, module)["state_dict"]
    both = set(GPT(**SMALL).state_dict()) & set(module.state_dict())
    assert set(state) == both and both < set(module.state_dict())
