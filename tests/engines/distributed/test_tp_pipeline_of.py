"""Tensor parallelism for a ``pipeline_of`` model from the model's own plan (``tensor_parallel=2``
without ``tensor_parallel_plan``: the Hugging Face config's ``base_model_tp_plan`` cut at each
pipelined layer, and transformers' ``tp_plan`` for the input embedding and the head, split over the
vocabulary).

Without processes: the plan derived for Llama and Qwen2 (every projection, the embedding and the
head; not the final norm) and GPT-NeoX (its fused query-key-value projection colwise, its tied
embedding and head whole), and the refusals (a plan entry naming nothing, a model without a plan
of its own, a style torch does not offer plainly, heads that do not divide), and
``checkpoint='auto'`` counting each rank's parameters by the derived plan as by the same plan given
explicitly. One launch of 4 real
processes (pp2 x tp2, data_parallel='fsdp' with dp=1, gloo on CPU,
tests/engines/distributed/tp_pipeline_of_worker.py) trains tiny HF Llama, Qwen2 (hidden 64,
4 heads, 2 KV heads, 4 layers) and GPT-NeoX (4 heads) 3 SGD steps on padded
batches with the gradient clipped by norm, and fills Llama on the meta device from a bf16
pretrained directory in at least 8 safetensors shards: the weights every process holds after
training are within 1e-5 relative of the model trained unpipelined in this process; each
projection is a DTensor of which each process holds half (by output features for colwise, by
input features for rowwise); each process reads exactly its own stage's keys and starts bitwise at
``from_pretrained(dir, dtype=float32)``, its shards bitwise the matching slices. One launch of 8
processes trains Qwen2 as pp2 x tp2 x dp2 on each replica's half of every batch: within the same
1e-5 of the model trained on the whole batches.
"""

import functools
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch
import transformers
from support.pretrained_models import reference, save
from support.toy import assert_bitwise_equal, max_relative_difference
from test_pretrained_distributed import _own_keys
from torch.utils.data import DataLoader
from tp_pipeline_of_worker import STEPS, FromScratch, batches, config

from pipeckpt import PipeckptConfigError, pipeline_of
from pipeckpt.engines.base import World
from pipeckpt.engines.distributed import DistributedEngine
from pipeckpt.engines.distributed.tensor_parallel import layer_plan
from pipeckpt.memory.sharding import Layout, rank_state
from pipeckpt.settings import PipeSettings

HERE = Path(__file__).resolve().parent
WORKER = HERE / "tp_pipeline_of_worker.py"
START_S = 600  # 3 short fits of 4 processes, or 1 of 8, on a loaded 2-core machine
PP2_TP2 = dict(balance=[2, 2], chunks=2, schedule="gpipe", tensor_parallel=2, data_parallel="fsdp")
SCRATCH = ("llama", "qwen2", "gpt_neox")
#: Llama's and Qwen2's base_model_tp_plan, inside a decoder layer.
LLAMA_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
#: GPT-NeoX's, inside a decoder layer: its query-key-value projection is one Linear whose columns
#: are grouped by head, so a colwise split gives each rank whole heads.
NEOX_PLAN = {
    "attention.query_key_value": "colwise",
    "attention.dense": "rowwise",
    "mlp.dense_h_to_4h": "colwise",
    "mlp.dense_4h_to_h": "rowwise",
}
PLANS = {"llama": LLAMA_PLAN, "qwen2": LLAMA_PLAN, "gpt_neox": NEOX_PLAN}
# Every step clips: the gradient's norm is 1.7 to 2.9 on these batches, so a norm that counted a
# split gradient's halves wrong would scale the steps.
CLIP = 1.0
TOLERANCE = 1e-5  # relative: the row-wise projections sum their halves over tp in another order


def _meta(name: str) -> Any:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config(name))


def _settings(**options: Any) -> PipeSettings:
    return PipeSettings(
        **dict(dict(engine="distributed", tensor_parallel=2, data_parallel="fsdp"), **options)
    )


# -- without processes -------------------------------------------------------------------


@pytest.mark.parametrize("name", ("llama", "qwen2"))
def test_a_pipeline_of_model_is_split_by_its_configs_plan_inside_each_layer(name):
    settings = layer_plan(pipeline_of(_meta(name), "model.layers"), _settings())
    # and, by transformers' own plan, the input embedding and the head over the vocabulary; the norm whole
    assert settings.tensor_parallel_plan == {
        **LLAMA_PLAN,
        "model.embed_tokens": "rowwise",
        "lm_head": "colwise",
    }


def test_gpt_neox_is_split_inside_each_layer_and_its_tied_embedding_and_head_stay_whole():
    settings = layer_plan(pipeline_of(_meta("gpt_neox"), "gpt_neox.layers"), _settings())
    assert settings.tensor_parallel_plan == NEOX_PLAN


def test_a_users_plan_entry_that_names_nothing_in_a_pipeline_of_model_is_refused_naming_it():
    plan = {"self_attn.q_proj": "colwise", "self_attn.qq_proj": "colwise"}
    with pytest.raises(PipeckptConfigError, match=r"(?s)'self_attn\.qq_proj'.*names none.*self_attn\.q_proj"):
        layer_plan(pipeline_of(_meta("llama"), "model.layers"), _settings(tensor_parallel_plan=plan))


def test_a_model_without_a_plan_of_its_own_and_no_tensor_parallel_plan_is_refused():
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2))
    with pytest.raises(
        PipeckptConfigError, match=r"(?s)pipeline_of\(GPT2LMHeadModel.*base_model_tp_plan.*has none.*HINT"
    ):
        layer_plan(pipeline_of(gpt2, "transformer.h"), _settings())


def test_a_model_plan_style_that_torch_does_not_offer_plainly_is_refused_naming_the_entry():
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    with torch.device("meta"):
        qwen3 = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**kw))
    with pytest.raises(
        PipeckptConfigError,
        match=r"(?s)model\.layers\.0\.self_attn\.q_norm as 'replicated_with_grad_allreduce'",
    ):
        layer_plan(pipeline_of(qwen3, "model.layers"), _settings())


def test_key_value_heads_that_the_tensor_parallel_ranks_do_not_divide_are_refused():
    with pytest.raises(PipeckptConfigError, match=r"(?s)tensor_parallel=4 with num_key_value_heads=2.*HINT"):
        layer_plan(pipeline_of(_meta("llama"), "model.layers"), _settings(tensor_parallel=4))


def test_a_users_plan_names_the_parts_outside_the_layers_by_their_path_in_the_model():
    plan = {**LLAMA_PLAN, "model.embed_tokens": "rowwise", "lm_head": "colwise"}
    settings = layer_plan(pipeline_of(_meta("llama"), "model.layers"), _settings(tensor_parallel_plan=plan))
    assert settings.tensor_parallel_plan == plan  # kept whole as given: the engine splits what it names


def test_outside_the_layers_a_plan_entry_other_than_a_vocabulary_split_is_refused_naming_it():
    for entry, style, named in [
        ("model.norm", "rowwise", "model.norm (LlamaRMSNorm)"),
        ("lm_head", "rowwise", "lm_head (Linear)"),
        ("model.embed_tokens", "colwise", "model.embed_tokens (Embedding)"),
    ]:
        plan = {**LLAMA_PLAN, entry: style}
        with pytest.raises(PipeckptConfigError, match=rf"(?s){re.escape(named)}.*over the vocabulary.*HINT"):
            layer_plan(pipeline_of(_meta("llama"), "model.layers"), _settings(tensor_parallel_plan=plan))


def test_a_tied_head_stays_whole_by_the_models_own_plan_and_a_plan_entry_naming_it_is_refused():
    tied_config = config("llama")
    tied_config.tie_word_embeddings = True  # Llama 3.2 1B's head, for one
    with torch.device("meta"):
        tied = transformers.LlamaForCausalLM(tied_config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    settings = layer_plan(pipeline_of(tied, "model.layers"), _settings())
    assert settings.tensor_parallel_plan == LLAMA_PLAN  # neither the embedding nor the head split
    plan = {**LLAMA_PLAN, "lm_head": "colwise"}
    with pytest.raises(
        PipeckptConfigError, match=r"(?s)entry 'lm_head' for lm_head: its weight is tied.*HINT.*untie"
    ):
        layer_plan(pipeline_of(tied, "model.layers"), _settings(tensor_parallel_plan=plan))


def _stage_params(options: Dict[str, Any]) -> List[int]:
    """The bytes of parameters ``checkpoint='auto'`` counts on a rank of each stage of a pp2 x tp2
    ``pipeline_of`` Llama (a world of 4), laid out as the engine tells it."""
    settings = _settings(stages=2, balance=[2, 2], chunks=2, schedule="gpipe", **options)
    engine = DistributedEngine(settings)
    engine.configure_world(World(num_nodes=1, num_processes=4))
    layers = pipeline_of(_meta("llama"), "model.layers")
    layout = Layout(**engine.memory_layout(layers))
    return [rank_state(list(layers)[at : at + 2], layout, "sgd").params for at in (0, 2)]


def test_auto_counts_a_pipeline_of_models_own_plan_as_the_same_plan_given_explicitly():
    derived, given = _stage_params({}), _stage_params(dict(tensor_parallel_plan=LLAMA_PLAN))
    assert derived == given
    unsplit = _stage_params(dict(tensor_parallel_plan={"mlp.up_proj": "colwise"}))
    assert all(d < u for d, u in zip(derived, unsplit))  # every projection split, not one


# -- real processes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("tp_pipeline_of")
    path = str(save("llama", out / "llama"))
    runs: List[Dict[str, Any]] = [
        dict(name=name, model=name, build="scratch", padded=True, clip=CLIP, strategy=PP2_TP2)
        for name in SCRATCH
    ]
    runs.append(
        dict(name="pretrained", model="llama", build="pretrained", path=path, padded=True, strategy=PP2_TP2)
    )
    yield ranks.launch(WORKER, 4, runs, out, within_s=START_S)


@pytest.fixture(scope="module")
def eight_processes(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("tp_pipeline_of_dp2")
    strategy = dict(PP2_TP2, dp=2)
    run = dict(name="qwen2_dp2", model="qwen2", build="scratch", padded=False, clip=CLIP, strategy=strategy)
    yield ranks.launch(WORKER, 8, [run], out, within_s=START_S)


def _saved(out: Path, run: str, rank: int) -> Dict[str, Any]:
    return torch.load(out / f"{run}_rank{rank}.pt", weights_only=True)


@functools.cache
def _reference(name: str, padded: bool) -> Dict[str, torch.Tensor]:
    """``name`` trained unpipelined in this process on the whole batches."""
    module = FromScratch(name)
    torch.manual_seed(123)
    data = DataLoader(batches(padded), batch_size=None)
    ranks.quiet_trainer("auto", 1, max_steps=STEPS, gradient_clip_val=CLIP).fit(module, data)
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def _trains_like_the_unpipelined_model(
    out: Path, run: str, world: int, expected: Dict[str, torch.Tensor]
) -> None:
    seen = set()
    for rank in range(world):
        trained = {k: v["whole"] for k, v in _saved(out, run, rank)["trained"].items()}
        seen |= set(trained)
        assert max_relative_difference(trained, {k: expected[k] for k in trained}) < TOLERANCE
    assert seen == set(expected)  # every weight is held by some process


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRATCH)
def test_pp2_tp2_trains_a_pipeline_of_model_like_the_unpipelined_one(four_processes, name):
    _trains_like_the_unpipelined_model(four_processes, name, 4, _reference(name, True))


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRATCH)
def test_each_projection_is_a_dtensor_of_which_each_process_holds_half(four_processes, name):
    for rank in range(4):
        held = _saved(four_processes, name, rank)["trained"]
        plan = PLANS[name]
        projections = {k: v for k, v in held.items() if k.endswith(".weight") and _inner(k) in plan}
        assert len(projections) == 2 * len(plan)  # the two layers of this rank's stage
        for key, v in projections.items():
            style = plan[_inner(key)]
            split = 0 if style == "colwise" else 1  # by output features, or by input features
            whole, local = v["whole"].shape, v["local"].shape
            assert "tp" in v["mesh"] and local[split] * 2 == whole[split], key
            assert local[1 - split] == whole[1 - split], key
        norms = [v for k, v in held.items() if k.endswith("layernorm.weight")]
        assert norms and all(v["local"].shape == v["whole"].shape for v in norms)  # not split (dp=1)


def _inner(key: str) -> str:
    """A parameter's submodule path inside its decoder layer (``self_attn.q_proj``)."""
    return ".".join(key.split(".")[-3:-1])


@pytest.mark.slow
def test_each_process_reads_exactly_its_own_stages_keys(four_processes):
    assert len(list((four_processes / "llama").glob("*.safetensors"))) >= 8
    for rank in range(4):
        saved = _saved(four_processes, "pretrained", rank)
        (stage,) = saved["stages"]
        assert saved["read"] == sorted(_own_keys(four_processes, "llama", stage))


@pytest.mark.slow
def test_every_process_starts_bitwise_at_from_pretrained_and_its_shards_at_the_slices(four_processes):
    want = reference(four_processes / "llama").state_dict()
    shards = 0
    for rank in range(4):
        saved = _saved(four_processes, "pretrained", rank)
        (stage,) = saved["stages"]
        held = saved["at_start"]
        assert set(held) == _own_keys(four_processes, "llama", stage)
        assert_bitwise_equal({k: v["whole"] for k, v in held.items()}, {k: want[k] for k in held})
        for key, v in held.items():
            if "local" in v:  # a DTensor (every tensor of a layer under FSDP, over dp=1 alone)
                assert torch.equal(v["local"], _slice(want[key], v)), key
                shards += "tp" in v["mesh"]
    # split over tp: every projection of each process's two layers, and its stage's embedding or head
    assert shards == 4 * (2 * len(LLAMA_PLAN) + 1)


@pytest.mark.slow
def test_each_process_reads_only_the_slices_its_shards_hold(four_processes):
    for rank in range(4):
        saved = _saved(four_processes, "pretrained", rank)
        held = saved["at_start"]  # in fp32; the directory holds bf16, 2 bytes an element
        shards = sum(v["local"].numel() for v in held.values() if "local" in v)
        whole = sum(v["whole"].numel() for v in held.values() if "local" not in v)  # outside the layers
        split = sum(v["whole"].numel() - v["local"].numel() for v in held.values() if "local" in v)
        assert split > 0  # the projections, and the embedding or head: half of each
        assert saved["bytes_read"] == 2 * (shards + whole)


def _slice(whole: torch.Tensor, held: Dict[str, Any]) -> torch.Tensor:
    """The part of ``whole`` that a DTensor laid out as ``held`` holds on its process, by the chunks
    of each mesh dimension it is sharded over (``Shard(dim=d)``)."""
    for placement, size, at in zip(held["placements"], held["sizes"], held["coordinate"]):
        if "Shard(dim=" in placement:
            dim = int(placement.split("dim=")[1].split(")")[0].split(",")[0])
            whole = whole.chunk(size, dim=dim)[at]
    return whole


@pytest.mark.slow
def test_pp2_tp2_dp2_trains_like_the_unpipelined_model_on_the_whole_batches(eight_processes):
    _trains_like_the_unpipelined_model(eight_processes, "qwen2_dp2", 8, _reference("qwen2", False))
