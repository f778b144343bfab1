"""Sequence parallelism (``sequence_parallel=True``): under tensor parallelism, each ``pipeline_of``
layer's norms and residual stream split along the sequence over the tensor-parallel processes.

Without processes: the roles found in HF Llama's and GPT-NeoX's decoder layers (their norms on a
part of the sequence, attention and the MLP gathered, each rowwise projection reduce-scattered), and
the refusals, each naming the user's value: a switch that is not a bool, sequence parallelism
without tensor parallelism, on an ``nn.Sequential`` pipeline, and a layer whose residual stream
holds a dropout that would draw per rank. One launch of 4 real processes (pp2 x tp2,
data_parallel='fsdp' with dp=1, gloo on CPU, tests/engines/distributed/tp_pipeline_of_worker.py)
trains tiny HF Llama (GPipe, no recompute), GPT-NeoX (1F1B, every layer recomputed, so every
collective runs again in the backward) and Qwen2 (selective recompute) 3 SGD steps on padded batches
with the gradient clipped by norm: the weights every process holds are within 1e-5 relative of the
model trained unpipelined in this process, and each norm's weight is replicated over tp (a DTensor
whose gradient was summed over both halves of the sequence). In the same launch, Llama built on the
meta device and filled from a bf16 pretrained directory starts bitwise at ``from_pretrained``, its
replicated norms too. One launch of 8 processes trains Llama as pp2 x tp2 x dp2 (FSDP2 over the
replicas on top, each replica its half of every batch): within the same 1e-5 of the model trained on
the whole batches.
"""

from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch
import transformers
from support.pretrained_models import reference, save
from support.toy import assert_bitwise_equal
from test_tp_pipeline_of import CLIP, START_S, _meta, _reference, _saved, _trains_like_the_unpipelined_model
from tp_pipeline_of_worker import config

from pipeckpt import PipeckptConfigError, pipeline_of
from pipeckpt.engines.distributed.sequence_parallel import SequenceRoles
from pipeckpt.engines.distributed.tensor_parallel import layer_plan
from pipeckpt.settings import PipeSettings

HERE = Path(__file__).resolve().parent
WORKER = HERE / "tp_pipeline_of_worker.py"
SP = dict(balance=[2, 2], chunks=2, tensor_parallel=2, data_parallel="fsdp", sequence_parallel=True)
RUNS = {
    "llama": dict(SP, schedule="gpipe"),
    "gpt_neox": dict(SP, schedule="1f1b", checkpoint="always"),
    "qwen2": dict(SP, schedule="gpipe", checkpoint="selective"),
}
LAYERS = {"llama": "model.layers", "gpt_neox": "gpt_neox.layers"}


def _settings(**options: Any) -> PipeSettings:
    base = dict(engine="distributed", tensor_parallel=2, data_parallel="fsdp", sequence_parallel=True)
    return PipeSettings(**{**base, **options})


def _roles(name: str) -> SequenceRoles:
    from pipeckpt.engines.distributed.sequence_parallel import sequence_roles

    spec = pipeline_of(_meta(name), LAYERS[name])
    plan = layer_plan(spec, _settings()).tensor_parallel_plan or {}
    return sequence_roles(spec[0], plan)


# -- without processes -------------------------------------------------------------------


def test_llamas_norms_run_on_a_part_of_the_sequence_and_its_blocks_gather_and_scatter():
    assert _roles("llama") == SequenceRoles(
        norms=("input_layernorm", "post_attention_layernorm"),
        gathered=("mlp", "self_attn"),
        scattered=("mlp.down_proj", "self_attn.o_proj"),
    )


def test_gpt_neoxs_norms_run_on_a_part_of_the_sequence_and_its_blocks_gather_and_scatter():
    assert _roles("gpt_neox") == SequenceRoles(
        norms=("input_layernorm", "post_attention_layernorm"),
        gathered=("attention", "mlp"),
        scattered=("attention.dense", "mlp.dense_4h_to_h"),
    )


def test_sequence_parallel_is_a_switch():
    from pipeckpt.engines.distributed.tensor_parallel import check_tensor_parallel

    with pytest.raises(PipeckptConfigError, match=r"(?s)sequence_parallel='yes'.*a switch"):
        check_tensor_parallel(_settings(sequence_parallel="yes"))


def test_sequence_parallel_without_tensor_parallelism_is_refused():
    from pipeckpt.engines.distributed.tensor_parallel import check_tensor_parallel

    with pytest.raises(PipeckptConfigError, match=r"(?s)sequence_parallel=True with tensor_parallel=1.*HINT"):
        check_tensor_parallel(_settings(tensor_parallel=1))


def test_sequence_parallel_on_an_nn_sequential_pipeline_is_refused():
    layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    plan = {"weight": "colwise"}  # never reached: the kind of pipeline is refused first
    with pytest.raises(PipeckptConfigError, match=r"(?s)nn\.Sequential pipeline \(Linear.*pipeline_of.*HINT"):
        from pipeckpt.engines.distributed.tensor_parallel import check_sequence_parallel

        check_sequence_parallel(layers, plan)


def test_a_dropout_in_the_residual_stream_is_refused_naming_the_layers_part():
    neox = config("gpt_neox")
    neox.hidden_dropout = 0.1  # Megatron's GPT: a dropout after attention and after the MLP
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(neox)
    with pytest.raises(
        PipeckptConfigError,
        match=r"(?s)on gpt_neox\.layers\.0\.post_attention_dropout \(Dropout\(p=0\.1\)\).*own mask.*HINT",
    ):
        layer_plan(pipeline_of(model, "gpt_neox.layers"), _settings())


# -- real processes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("sequence_parallel")
    runs: List[Dict[str, Any]] = [
        dict(name=name, model=name, build="scratch", padded=True, clip=CLIP, strategy=strategy)
        for name, strategy in RUNS.items()
    ]
    path = str(save("llama", out / "llama"))
    strategy = RUNS["llama"]
    runs.append(
        dict(name="pretrained", model="llama", build="pretrained", path=path, padded=True, strategy=strategy)
    )
    yield ranks.launch(WORKER, 4, runs, out, within_s=START_S)


@pytest.fixture(scope="module")
def eight_processes(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("sequence_parallel_dp2")
    strategy = dict(RUNS["llama"], dp=2)
    run = dict(name="llama_dp2", model="llama", build="scratch", padded=False, clip=CLIP, strategy=strategy)
    yield ranks.launch(WORKER, 8, [run], out, within_s=START_S)


@pytest.mark.slow
def test_pp2_tp2_dp2_with_sequence_parallelism_trains_like_the_unpipelined_model(eight_processes):
    _trains_like_the_unpipelined_model(eight_processes, "llama_dp2", 8, _reference("llama", False))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_pp2_tp2_with_sequence_parallelism_trains_like_the_unpipelined_model(four_processes, name):
    _trains_like_the_unpipelined_model(four_processes, name, 4, _reference(name, True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_each_norm_is_replicated_over_the_tensor_parallel_processes(four_processes, name):
    for rank in range(4):
        held = _saved(four_processes, name, rank)["trained"]
        norms = {k: v for k, v in held.items() if k.endswith("layernorm.weight")}
        assert len(norms) == 2 * 2  # two per layer, two layers a stage
        for key, v in norms.items():
            assert "tp" in v["mesh"] and v["local"].shape == v["whole"].shape, key
            assert v["placements"][v["mesh"].index("tp")] == "Replicate()", key


@pytest.mark.slow
def test_a_pretrained_llama_starts_bitwise_at_from_pretrained_its_norms_replicated(four_processes):
    want = reference(four_processes / "llama").state_dict()
    norms = 0
    for rank in range(4):
        held = _saved(four_processes, "pretrained", rank)["at_start"]
        assert_bitwise_equal({k: v["whole"] for k, v in held.items()}, {k: want[k] for k in held})
        for key, v in held.items():
            if key.endswith("layernorm.weight"):
                assert v["placements"][v["mesh"].index("tp")] == "Replicate()", key
                assert torch.equal(v["local"], want[key]), key
                norms += 1
    assert norms == 4 * 2 * 2  # each process: two layers of two norms
