"""Under the distributed engine each rank of a ``pipeline_of`` model holds, of the parameters outside
its layers, what its stage reads (engines/distributed/outside_parts.py), and the memory model counts
exactly that per stage (memory/outside_share.py): HF Llama (untied head) and GPT-2 (head tied to the
embedding, held by both ends), profiled from token ids, 2 stages of 2 layers, GPipe."""

from typing import Dict

import torch
import transformers as hf
from torch import nn

from pipeckpt import pipeline_of
from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.engines.distributed.tensor_parallel import layer_plan
from pipeckpt.memory.outside_share import outside_params
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import profile
from pipeckpt.memory.rooted import RootInput
from pipeckpt.memory.sharding import Layout, stage_rank_states
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.partition import StagePlan

IDS = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
CPU = torch.device("cpu")
PLAN = StagePlan(balance=(2, 2), devices=(CPU, CPU), modes=parse_modes("never", 2))


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _stage_params(model: nn.Module, layers: str, schedule: str) -> Dict[int, int]:
    fitted = profile(pipeline_of(model, layers), RootInput((), dict(input_ids=IDS)), rounds=1)
    prediction = predict(fitted, PLAN, chunks=2, optimizer="sgd", schedule=schedule)
    return {j: s.params for j, s in enumerate(prediction.stages)}


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = hf.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    return hf.LlamaForCausalLM(config)


def test_each_rank_counts_the_outside_parameters_its_stage_reads() -> None:
    model = _llama()
    layers = model.model.layers
    stage = _stage_params(model, "model.layers", "gpipe")
    assert stage[0] == _bytes(layers[0]) + _bytes(layers[1]) + _bytes(model.model.embed_tokens)
    assert stage[1] == _bytes(layers[2]) + _bytes(layers[3]) + _bytes(model.model.norm) + _bytes(
        model.lm_head
    )


def test_a_tied_embedding_counts_on_both_ranks_that_hold_a_copy() -> None:
    torch.manual_seed(0)
    config = hf.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    model = hf.GPT2LMHeadModel(config)
    t = model.transformer
    stage = _stage_params(model, "transformer.h", "gpipe")
    assert stage[0] == _bytes(t.h[0]) + _bytes(t.h[1]) + _bytes(t.wte) + _bytes(t.wpe)
    assert stage[1] == _bytes(t.h[2]) + _bytes(t.h[3]) + _bytes(t.wte) + _bytes(t.ln_f)


def test_the_local_engine_counts_them_all_on_its_last_stage() -> None:
    model = _llama()
    layers = model.model.layers
    stage = _stage_params(model, "model.layers", "local")
    outside = _bytes(model.model.embed_tokens) + _bytes(model.model.norm) + _bytes(model.lm_head)
    assert stage[0] == _bytes(layers[0]) + _bytes(layers[1])
    assert stage[1] == _bytes(layers[2]) + _bytes(layers[3]) + outside


def test_under_tp2_the_embedding_and_head_count_half_their_rows_by_the_models_own_plan() -> None:
    """``memory.tp=2`` (and ``checkpoint='auto'``) count what the engine splits over the vocabulary
    (engines/distributed/vocab_plan.py): half of each vocabulary matrix per rank; the norm whole."""
    model = _llama()
    spec = pipeline_of(model, "model.layers")
    outside, _ = outside_params(spec, RootInput((), dict(input_ids=IDS)))
    settings = PipeSettings(engine="distributed", tensor_parallel=2, data_parallel="fsdp")
    plan = layer_plan(spec, settings).tensor_parallel_plan
    assert plan is not None and plan["model.embed_tokens"] == "rowwise" and plan["lm_head"] == "colwise"
    layout = Layout(tp=2, tp_plan=tuple(plan.items()))
    split = [rank for rank, _ in stage_rank_states(spec, layout, "sgd", outside)((2, 2))]
    layers = [rank for rank, _ in stage_rank_states(spec, layout, "sgd", None)((2, 2))]
    embed, norm, head = _bytes(model.model.embed_tokens), _bytes(model.model.norm), _bytes(model.lm_head)
    assert split[0].params == layers[0].params + embed // 2
    assert split[1].params == layers[1].params + norm + head // 2
    inside = tuple((k, v) for k, v in plan.items() if k not in ("model.embed_tokens", "lm_head"))
    whole = [
        rank for rank, _ in stage_rank_states(spec, Layout(tp=2, tp_plan=inside), "sgd", outside)((2, 2))
    ]
    assert whole[1].params == layers[1].params + norm + head  # without their entries: whole


def test_under_tp2_a_ranks_predicted_stage_holds_its_share_of_the_embedding_and_head_once() -> None:
    """The search's and ``checkpoint='auto'``'s prediction of a rank (``rank_peak.on_rank``: the walk's
    stage, whose parameters are as built, less the unsharded state, plus the rank's share) holds
    half of each vocabulary matrix, as the engine does: the unsharded state counts them whole, as
    the walk does (split there too, the other half came back as "beyond the layers": +18 MiB on
    the measured Llama at tp 4, benchmarks/RESULTS_layout.md); beside it FSDP2's gathered copy of the
    same share, as the engine runs tensor parallelism under FSDP2 even at a shard degree of 1."""
    from pipeckpt.memory.rank_peak import on_rank

    model = _llama()
    spec = pipeline_of(model, "model.layers")
    fitted = profile(spec, RootInput((), dict(input_ids=IDS)), rounds=1)
    settings = PipeSettings(engine="distributed", tensor_parallel=2, data_parallel="fsdp")
    layout = Layout(tp=2, tp_plan=tuple(layer_plan(spec, settings).tensor_parallel_plan.items()))
    states = stage_rank_states(spec, layout, "sgd", fitted.outside_params)((2, 2))
    prediction = predict(fitted, PLAN, chunks=2, optimizer="sgd", schedule="gpipe")
    ranks = [on_rank(s, mine, whole) for s, (mine, whole) in zip(prediction.stages, states)]
    assert [mine.unsharded for mine, _ in states] == [mine.params for mine, _ in states]  # fp32, dp 1
    assert [r.params for r in ranks] == [mine.params + mine.unsharded for mine, _ in states]
    assert [whole.params for _, whole in states] == [s.params for s in prediction.stages]
