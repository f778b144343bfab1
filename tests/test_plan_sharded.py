"""``python -m pipeckpt.plan ... memory.fsdp=N memory.tp=N``: one rank's table per stage."""

from typing import Dict, List, Tuple

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


HF_TP = [
    "model=hf",
    "strategy.engine=distributed",
    "strategy.stages=2",
    "strategy.chunks=2",
    "trainer.devices=4",
    "strategy.tensor_parallel=2",
    "strategy.data_parallel=fsdp",
    "ckpt=always",
    "memory.fake=true",
    "memory.tp=2",
]


def _rank_rows(capsys: pytest.CaptureFixture[str], *extra: str) -> Tuple[str, List[Dict[str, str]]]:
    assert main([*HF_TP, *extra]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    at = next(i for i, line in enumerate(lines) if line.startswith("one rank per stage"))
    header = lines[at + 1].split()
    return lines[at], [dict(zip(header, line.split())) for line in lines[at + 2 : at + 4]]


def test_sequence_parallelism_is_named_and_halves_what_crosses_each_stage_boundary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, alone = _rank_rows(capsys)
    title, sequence = _rank_rows(capsys, "strategy.sequence_parallel=true")
    assert "tp 2" in title and "sequence parallel" in title
    # the last stage receives the hidden state: one rank's half of the sequence
    assert float(sequence[1]["boundary"]) == float(alone[1]["boundary"]) / 2
    for a, s in zip(alone, sequence):
        assert float(s["activations"]) < float(a["activations"])
        assert s["params"] == a["params"]  # the split of the weights is tensor parallelism's


def test_sequence_parallelism_on_a_model_built_as_one_ranks_share_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [*ARGS, "trainer.devices=4", "strategy.tensor_parallel=2", "strategy.data_parallel=fsdp"]
    assert main([*args, "memory.tp=2", "strategy.sequence_parallel=true"]) == 1
    assert "sequence_parallel=True on an nn.Sequential pipeline" in capsys.readouterr().err


@pytest.mark.parametrize("accelerator, gloo", [("cpu", True), ("gpu", False)])
def test_a_cpu_runs_ranks_count_gloos_staging_copy_of_a_reduce_scatter(
    capsys: pytest.CaptureFixture[str], accelerator: str, gloo: bool
) -> None:
    # on CPU Lightning's process group is gloo's, whose reduce-scatter copies its input
    # (tests/memory/test_gloo_staging.py); gradients reduced in every backward show it
    args = [*ARGS, "memory.fsdp=2", "memory.reduce_every=true", f"trainer.accelerator={accelerator}"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    row = dict(zip(lines[1].split(), lines[2].split()))
    assert row["at"] == "B1"  # a backward: its reduce-scatter's buffers counted
    layers = list(llama_layers(llama_config("tiny", seq_len=128)))
    layout = Layout(fsdp=2, precision="bf16-mixed", reduce_every_microbatch=True, gloo=gloo)
    state = rank_state(layers[:2], layout, "adamw")
    assert float(row["collectives"]) == round((state.collectives + state.staged) / MiB, 2)
    assert (state.staged > 0) == gloo
