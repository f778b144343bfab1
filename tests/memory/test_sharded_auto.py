"""``checkpoint='auto'`` under the distributed engine with sharded stages: the peak compared with the
budget is one rank's (pipeckpt/memory/sharding.py's rules), for the topology the engine resolved.

No processes: the engine's topology comes from ``configure_world`` (pp2 x fsdp2 on a world of 4),
the choice from :func:`~pipeckpt.memory.budget.resolve_auto` on one process's profile. The model: an
MLP of six 256 x 256 Linear layers and AdamW, two stages of three blocks; at its least-memory plan a
rank of the sharded stage holds about 3.3 MiB, a DDP replica about 3.5 MiB.
"""

import functools
import re
from typing import Any, Dict, Optional

import pytest
import torch
from support.hf_models import HFModule, batches, whole
from test_sharding import _local, fake_world
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.models import MLP
from pipeckpt.app.models.llama import llama_config, llama_layers
from pipeckpt.engines.base import World
from pipeckpt.engines.distributed import DistributedEngine
from pipeckpt.memory.auto import with_balance_modes
from pipeckpt.memory.budget import AutoPlan, first_microbatch, resolve_auto
from pipeckpt.memory.outside_share import units
from pipeckpt.memory.predict import predict, with_balance
from pipeckpt.memory.profile import ModelProfile, profile
from pipeckpt.memory.rank_peak import per_rank
from pipeckpt.memory.rooted import RootInput
from pipeckpt.memory.sharding import Layout, rank_state, split_shapes
from pipeckpt.settings import PipeSettings

BATCH = torch.randn(8, 64)
SMALLEST = re.compile(r"the smallest feasible budget is [\d.]+ \w+ \((\d+) bytes\)")


def _settings(data_parallel: str, budget: Any, **more: Any) -> PipeSettings:
    given: Dict[str, Any] = dict(stages=2, chunks=2, schedule="gpipe", memory_optimizer="adamw", dp=2)
    return PipeSettings(
        engine="distributed",
        checkpoint="auto",
        memory_budget=budget,
        data_parallel=data_parallel,
        **{**given, **more},
    )


def _layout(settings: PipeSettings) -> Optional[Layout]:
    """What the engine tells auto on a world of 4 (pp2 x dp2), as :func:`resolve_for` reads it."""
    engine = DistributedEngine(settings)
    engine.configure_world(World(num_nodes=1, num_processes=4))
    spread = engine.memory_layout()
    return Layout(**spread) if spread else None


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP(in_features=64, hidden=256, depth=6, num_classes=4)


@functools.cache
def _profile() -> ModelProfile:
    """One micro-batch's profile, shared by every choice here (the same profile, the same choice)."""
    return profile(_model().layers, first_microbatch(BATCH, 2), rounds=2)


def _auto(data_parallel: str, budget: Any, **more: Any) -> AutoPlan:
    settings = _settings(data_parallel, budget, **more)
    return resolve_auto(
        settings,
        _model().layers,
        devices=[torch.device("cpu")],
        batch=BATCH,
        profiles={2: _profile()},
        layout=_layout(settings),
    )


def _smallest(data_parallel: str) -> int:
    with pytest.raises(PipeckptConfigError) as refused:
        _auto(data_parallel, 1)
    found = SMALLEST.search(str(refused.value))
    assert found is not None, refused.value
    return int(found[1])


def test_the_engine_tells_auto_the_topologys_shard_degree_and_reshard_policy() -> None:
    spread = _layout(_settings("fsdp", "1GiB", reshard_after_forward=True))
    on_cpu = True  # gloo: its reduce-scatter's staging copy counted
    assert spread == Layout(fsdp=2, tp=1, reshard_after_forward=True, precision="32-true", gloo=on_cpu)


def test_under_hybrid_sharding_the_engine_tells_auto_the_shard_groups_degree() -> None:
    engine = DistributedEngine(_settings("fsdp", "1GiB", dp=4, dp_shard=2))
    engine.configure_world(World(num_nodes=1, num_processes=8))  # pp2 x (2 replicate x 2 shard)
    assert engine.memory_layout()["fsdp"] == 2  # each rank holds half a stage, not a quarter


def test_under_ddp_the_engine_tells_auto_every_replica_holds_its_stage_whole() -> None:
    assert _layout(_settings("ddp", "1GiB")) is None


def test_a_budget_only_the_sharded_count_fits_is_accepted_under_fsdp_and_refused_under_ddp() -> None:
    sharded, whole = _smallest("fsdp"), _smallest("ddp")
    assert sharded < whole
    budget = (sharded + whole) // 2
    chosen = _auto("fsdp", budget)
    assert chosen.choice.prediction.peak <= budget
    assert "counted per rank: fsdp=2, tp=1" in chosen.describe()
    with pytest.raises(PipeckptConfigError, match=rf"the smallest feasible budget is .* \({whole} bytes\)"):
        _auto("ddp", budget)


def test_each_stages_peak_auto_compares_is_the_per_rank_peak_of_the_sharding_rules() -> None:
    layout = _layout(_settings("fsdp", "1GiB"))
    assert layout is not None
    layers, chosen = _model().layers, _auto("fsdp", "1GiB")
    c, balance = chosen.choice.chunks, chosen.choice.balance
    plan = with_balance(with_balance_modes(balance, chosen.choice.modes[0]), balance, chosen.choice.modes)
    whole = predict(chosen.profiles[c], plan, chunks=c, optimizer="adamw", schedule="gpipe")
    starts = [0, balance[0]]
    expected = [
        per_rank(stage, rank_state(list(layers)[a : a + n], layout, "adamw")).peak
        for stage, a, n in zip(whole.stages, starts, balance)
    ]
    assert [s.peak for s in chosen.choice.prediction.stages] == expected
    assert expected != [s.peak for s in whole.stages]  # the sharded count differs from the whole one


#: Megatron-style TP of a Llama block: q, k, v, gate, up column-wise; o, down row-wise.
TP_PLAN: Dict[str, str] = {
    **{f"layer.self_attn.{n}_proj": "colwise" for n in "qkv"},
    "layer.mlp.gate_proj": "colwise",
    "layer.mlp.up_proj": "colwise",
    "layer.self_attn.o_proj": "rowwise",
    "layer.mlp.down_proj": "rowwise",
}


def test_a_tensor_parallel_plan_splits_each_parameter_as_torchs_styles_do() -> None:
    torch.manual_seed(0)
    block = llama_layers(llama_config("tiny", seq_len=16))[1]
    whole = [(tuple(p.shape), p.requires_grad) for p in block.parameters()]
    predicted = split_shapes(block, Layout(tp=2, tp_plan=tuple(TP_PLAN.items())))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    with fake_world(2) as mesh:
        parallelize_module(block, mesh, {name: styles[style]() for name, style in TP_PLAN.items()})
        held = [(tuple(_local(p).shape), p.requires_grad) for p in block.parameters()]
    assert predicted == held and predicted != whole


def test_a_pipeline_of_models_own_parameters_count_sharded_on_the_stage_that_alone_reads_them() -> None:
    # As the engine shards them (engines/distributed/outside_parts.py): the embedding with the first
    # stage's layers, the final norm and the head with the last's.
    module = HFModule("llama", whole)
    spec = module.configure_pipeline()
    ids = batches(1)[0]["input_ids"]
    settings = _settings("fsdp", "1GiB", stages=None, balance=[2, 2])
    layout = Layout(fsdp=2)
    batch = RootInput.of(ids)
    once = {2: profile(spec, first_microbatch(batch, 2), rounds=1)}  # the parameters need no timing
    chosen = resolve_auto(
        settings, spec, devices=[torch.device("cpu")], batch=batch, profiles=once, layout=layout
    )
    reads = [["model.embed_tokens.weight"], ["model.norm.weight", "lm_head.weight"]]
    assert not module.model.config.tie_word_embeddings
    for j, (stage, names) in enumerate(zip(chosen.choice.prediction.stages, reads)):
        state = rank_state([*list(spec)[2 * j : 2 * j + 2], *units(module.model, names)], layout, "adamw")
        assert stage.params == state.params + state.unsharded, f"stage {j}"
