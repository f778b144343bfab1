"""``python -m pipeckpt.plan ... memory.fsdp=N memory.tp=N``: one rank's table per stage."""

import pytest
import torch

from pipeckpt.app.models.llama import llama_config, llama_layers
from pipeckpt.memory.sharding import Layout, rank_state
from pipeckpt.plan import main
from pipeckpt.sizes import MiB

ARGS = [
    "model=llama3",
    "strategy.engine=distributed",
    "strategy.stages=2",
    "strategy.balance=[2,2]",
    "strategy.chunks=2",
    "data.batch_size=4",
    "ckpt=always",
    "trainer.precision=bf16-mixed",
    "memory.fake=true",
]


def test_the_plan_prints_one_ranks_sharded_state_per_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "memory.fsdp=2", "memory.tp=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("one rank per stage: fsdp 2, tp 2, reshard_after_forward False, bf16-mixed")
    header = lines[1].split()
    rows = [dict(zip(header, line.split())) for line in lines[2:4]]
    layers = list(llama_layers(llama_config("tiny", seq_len=128, tensor_parallel=2)))
    layout = Layout(fsdp=2, tp=2, precision="bf16-mixed")
    for row, stage in zip(rows, (layers[:2], layers[2:])):
        state = rank_state(stage, layout, "adamw")
        assert float(row["params"]) == round(state.params / MiB, 2)
        assert float(row["unsharded"]) == round(state.unsharded / MiB, 2)
        assert float(row["peak"]) > float(row["activations"]) > 0


def test_a_tensor_parallel_degree_for_a_model_without_one_is_a_configuration_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["model=mlp", "memory.tp=2"]) == 1
    assert "memory.tp=2 with model._target_=pipeckpt.app.models.MLP" in capsys.readouterr().err


def test_a_degree_that_is_not_a_whole_number_is_a_configuration_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["model=llama3", "memory.fsdp=two"]) == 1
    assert "memory.fsdp=two: a degree is a whole number" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _default_dtype_restored() -> None:
    dtype = torch.get_default_dtype()
    yield
    assert torch.get_default_dtype() == dtype
