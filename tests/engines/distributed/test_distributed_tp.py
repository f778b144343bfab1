"""Tensor parallelism inside every stage (``tensor_parallel=2``) on top of FSDP2 under the pipeline.

Without processes: the settings that cannot run are refused when the Trainer is built. One launch
of 8 real processes (pp2 x dp2 x tp2, gloo on CPU, tests/engines/distributed/distributed_tp_worker.py)
trains the bundled Llama ``tiny`` with its decoder layers split by Megatron's plan, under 1f1b with
every stage checkpointed and the gradient clipped by norm, resuming an epoch trained as pp2 x fsdp4.
Replica r reads rows 4r..4r+3 of every batch of 8; the weights after 6 AdamW steps are compared with
the module trained in this process on the whole batches: within 1e-5 relative. The local engine
resumes the split run's checkpoint for a third epoch: within 1e-6 of the uninterrupted run. In the
same launch, hybrid sharding (pp2 x (replicate 2 x shard 2), ``dp_shard=2``) resumes the pp2 x fsdp4
epoch too: 4 replicas of 2 rows each, the same 1e-5. And pp2 x tp2 x fsdp2 under checkpoint='auto'
trains an epoch within a budget that a stage split by the plan fits and one held by FSDP alone does
not: every rank builds rank 0's choice, and the weights match the same 1e-5. A launch of 16
processes trains hybrid sharding and tensor parallelism together (pp2 x (replicate 2 x shard 2) x
tp2): a split weight is a quarter per process, the rest half, and the weights match the same 1e-5.
"""

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import support.ranks as ranks
import torch
from distributed_tp_worker import PLAN, TinyLlama, batches, loader, replica_rows
from support.toy import max_relative_difference
from test_distributed_auto import _smallest_budget
from test_distributed_pytree import _state

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt.engines.base import World
from pipeckpt.engines.distributed.engine import DistributedEngine
from pipeckpt.memory.sharding import Layout
from pipeckpt.settings import PipeSettings

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_tp_worker.py"
WORLD, DP, TP = 8, 2, 2
START_S = 600  # two trainings of 8 processes on a loaded 2-core machine
EPOCH, CLIP = 3, 0.5  # steps of the data (3 batches); the gradient's norm is above CLIP: every step clips
SPLIT = dict(
    dp=DP,
    tensor_parallel=TP,
    tensor_parallel_plan=PLAN,
    data_parallel="fsdp",
    balance=[2, 2],
    chunks=2,
    schedule="1f1b",
    checkpoint="always",
)
# A resume chain through the split layout: pp2 x fsdp4 trains the first epoch, pp2 x tp2 x fsdp2
# resumes it for the second (both in the one launch of 8 processes), the local engine (1 stage, this
# process) the third. Each leg is a new Trainer and module: only the checkpoint carries the run.
FSDP4 = dict(dp=4, data_parallel="fsdp", balance=[2, 2], chunks=2, schedule="gpipe")
FIRST = dict(name="pp2_fsdp4", steps=EPOCH, clip=CLIP, checkpoint_every=EPOCH, strategy=FSDP4)
RUN = dict(
    name="pp2_tp2_fsdp2",
    steps=2 * EPOCH,
    clip=CLIP,
    checkpoint_every=EPOCH,
    strategy=SPLIT,
    resume="pp2_fsdp4/epoch=0-step=3.ckpt",
)
SPLIT_SAVED = "pp2_tp2_fsdp2/epoch=1-step=6.ckpt"
# Hybrid sharding: the 4 replicas of each pipeline rank as 2 groups of 2 that each hold one copy of
# the shards (FSDP2's HSDP), resuming the same pp2 x fsdp4 epoch into this layout.
HDP, SHARD = 4, 2
HYBRID = dict(
    dp=HDP,
    dp_shard=SHARD,
    data_parallel="fsdp",
    balance=[2, 2],
    chunks=2,
    schedule="1f1b",
    checkpoint="always",
)
HYBRID_RUN = dict(
    name="pp2_hsdp", steps=2 * EPOCH, clip=CLIP, strategy=HYBRID, resume="pp2_fsdp4/epoch=0-step=3.ckpt"
)

# checkpoint="auto" with the stages split by the plan: a budget (bytes per rank) that a stage held as
# tp2 x fsdp2 fits and one held as fsdp2 alone does not (smallest feasible: 1.04 and 1.30 MB since
# a stage's gradients count whole until the step's end; 1.20 and 1.45 before), and that `never`
# everywhere does not: 1.17 MB did until auto profiled the layers cut to one tp rank (2026-12-05).
TP_BUDGET = 1_100_000
AUTO_RUN = dict(
    name="pp2_tp2_fsdp2_auto",
    steps=EPOCH,
    clip=CLIP,
    strategy=dict(SPLIT, checkpoint="auto", memory_budget=TP_BUDGET),
)

# Hybrid sharding and tensor parallelism together: pp2 x (replicate 2 x shard 2) x tp2, 16 processes.
HYBRID_TP_WORLD = 16
HYBRID_TP_RUN = dict(
    name="pp2_hsdp_tp2",
    steps=EPOCH,
    clip=CLIP,
    strategy=dict(HYBRID, tensor_parallel=TP, tensor_parallel_plan=PLAN),
)
SPLIT_BY_PLAN = ("_proj.",)  # the parameters the plan splits (attention's and the MLP's projections)

# -- without processes -------------------------------------------------------------------


def _checked(**settings: Any) -> None:
    DistributedEngine.check_settings(PipeSettings(engine="distributed", **settings))


def test_tensor_parallel_without_a_plan_is_refused_for_a_sequential_where_its_layers_are_known():
    from pipeckpt.engines.distributed.tensor_parallel import layer_plan

    _checked(tensor_parallel=2, data_parallel="fsdp")  # a pipeline_of model may bring its own plan
    settings = PipeSettings(engine="distributed", tensor_parallel=2, data_parallel="fsdp")
    with pytest.raises(
        PipeckptConfigError, match=r"(?s)tensor_parallel=2 without tensor_parallel_plan.*HINT"
    ):
        layer_plan(TinyLlama().layers, settings)


def test_tensor_parallel_under_ddp_is_refused_naming_fsdp():
    with pytest.raises(PipeckptConfigError, match=r"(?s)tensor_parallel=2 with data_parallel='ddp'.*'fsdp'"):
        _checked(tensor_parallel=2, tensor_parallel_plan=PLAN)


def test_a_plan_naming_an_unknown_style_is_refused_naming_the_styles():
    with pytest.raises(PipeckptConfigError, match=r"(?s)'sequence'.*\['colwise', 'rowwise'\]"):
        _checked(tensor_parallel=2, tensor_parallel_plan={"mlp.up": "sequence"}, data_parallel="fsdp")


def test_a_world_that_tensor_parallel_does_not_divide_is_refused_when_the_trainer_is_built():
    strategy = PipelineStrategy(
        engine="distributed", tensor_parallel=3, tensor_parallel_plan=PLAN, data_parallel="fsdp"
    )
    with pytest.raises(PipeckptConfigError, match=r"(?s)tensor_parallel=3 with a world of 4 processes.*HINT"):
        ranks.quiet_trainer(strategy, 4)


def test_a_world_of_pp_x_dp_x_tp_is_split_tensor_parallel_innermost():
    from pipeckpt.engines.distributed.schedules import lookup
    from pipeckpt.engines.distributed.topology import resolve

    t = resolve(world=8, stages=2, virtual_stages=1, dp=None, chunks=2, kind=lookup("1f1b"), tp=2)
    assert (t.pp, t.dp, t.tp) == (2, 2, 2)
    assert [t.pipeline_rank_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [t.replica_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_stage_is_found_on_its_pipeline_rank_whatever_the_tensor_parallel_split():
    from pipeckpt.engines.distributed.schedules import lookup
    from pipeckpt.engines.distributed.topology import resolve

    t = resolve(world=8, stages=2, virtual_stages=1, dp=None, chunks=2, kind=lookup("1f1b"), tp=2)
    assert [t.rank_of(j) for j in range(2)] == [0, 1]  # pipeline ranks, not global ranks
    assert [t.global_rank(1, 1, k) for k in range(2)] == [6, 7]
    assert [t.stages_of(r) for r in range(8)] == [[0], [0], [1], [1], [0], [0], [1], [1]]


def test_dp_shard_under_ddp_is_refused_naming_fsdp():
    with pytest.raises(PipeckptConfigError, match=r"(?s)dp_shard=2 with data_parallel='ddp'.*'fsdp'"):
        _checked(dp_shard=2)


def test_a_dp_shard_that_is_not_a_count_is_refused():
    with pytest.raises(PipeckptConfigError, match=r"(?s)dp_shard=0.*integer number >= 1.*HINT"):
        _checked(dp_shard=0, data_parallel="fsdp")


def test_a_dp_shard_that_does_not_divide_dp_is_refused_when_the_trainer_is_built():
    strategy = PipelineStrategy(engine="distributed", dp=4, dp_shard=3, data_parallel="fsdp")
    with pytest.raises(PipeckptConfigError, match=r"(?s)dp_shard=3 with dp=4.*must divide dp.*\[1, 2, 4\]"):
        ranks.quiet_trainer(strategy, 4)


def test_hybrid_sharding_shards_over_consecutive_replicas_and_replicates_across_their_groups():
    from pipeckpt.engines.distributed.schedules import lookup
    from pipeckpt.engines.distributed.topology import resolve

    t = resolve(world=8, stages=2, virtual_stages=1, dp=4, chunks=2, kind=lookup("1f1b"), dp_shard=2)
    assert (t.pp, t.dp, t.dp_shard) == (2, 4, 2)
    # global rank = replica x pp + pipeline rank; replicas {0, 1} and {2, 3} each hold one copy
    assert [t.shard_group(r) for r in range(8)] == [[0, 2], [1, 3]] * 2 + [[4, 6], [5, 7]] * 2
    assert [t.replicate_group(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    split = resolve(
        world=16, stages=2, virtual_stages=1, dp=4, chunks=2, kind=lookup("1f1b"), tp=2, dp_shard=2
    )
    assert (split.shard_group(5), split.replicate_group(5)) == ([1, 5], [5, 13])  # at tp rank 1 of pp 0


def test_a_dp_shard_of_every_replica_is_plain_sharding():
    from pipeckpt.engines.distributed.schedules import lookup
    from pipeckpt.engines.distributed.topology import resolve

    t = resolve(world=8, stages=2, virtual_stages=1, dp=4, chunks=2, kind=lookup("1f1b"), dp_shard=4)
    assert t.dp_shard is None
    assert t.shard_group(1) == [1, 3, 5, 7] and t.replicate_group(1) == [1]


def test_a_plan_entry_that_names_no_layer_is_refused_naming_the_entry():
    from pipeckpt.engines.distributed.tensor_parallel import check_plan

    module = TinyLlama()
    with pytest.raises(PipeckptConfigError, match=r"(?s)'layer.attn.q'.*names none.*self_attn"):
        check_plan(list(module.layers), {"layer.attn.q": "colwise"})


def test_the_auto_budget_fits_a_stage_split_by_tensor_parallel_and_not_one_held_by_fsdp_alone():
    module = TinyLlama()
    x, _ = replica_rows(batches(), 0, DP)[0]  # what rank 0 profiles: its replica's first batch

    def smallest(settings: PipeSettings, processes: int) -> int:
        engine = DistributedEngine(settings)
        engine.configure_world(World(num_nodes=1, num_processes=processes))
        return _smallest_budget(settings, Layout(**engine.memory_layout()), module, x)

    split = PipeSettings(engine="distributed", **AUTO_RUN["strategy"])
    unsplit = replace(split, tensor_parallel=1, tensor_parallel_plan=None)
    assert smallest(split, WORLD) < TP_BUDGET < smallest(unsplit, WORLD // TP)


# -- eight real processes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def eight_processes(tmp_path_factory) -> Iterator[Path]:
    runs = [FIRST, RUN, HYBRID_RUN, AUTO_RUN]
    yield ranks.launch(WORKER, WORLD, runs, tmp_path_factory.mktemp("tp"), within_s=START_S)


@pytest.fixture(scope="module")
def sixteen_processes(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("hsdp_tp")
    yield ranks.launch(WORKER, HYBRID_TP_WORLD, [HYBRID_TP_RUN], out, within_s=START_S)


@functools.cache
def _reference(steps: int) -> Dict[str, torch.Tensor]:
    """The module trained uninterrupted in this process on the replicas' rows joined (the whole
    batches)."""
    module = TinyLlama()
    torch.manual_seed(123)
    ranks.quiet_trainer("auto", 1, max_steps=steps, gradient_clip_val=CLIP).fit(module, loader(batches()))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.slow
def test_pp2_tp2_fsdp2_trains_like_one_process_on_the_joined_batch(eight_processes):
    got = _state(eight_processes / "pp2_tp2_fsdp2.ckpt")["state_dict"]
    expected = _reference(2 * EPOCH)
    assert sorted(got) == sorted(expected)  # the unpipelined module's keys, each once
    assert max_relative_difference(got, expected) < 1e-5  # the clipping norm counts each element once


@pytest.mark.slow
def test_the_checkpoint_loads_strictly_into_the_unpipelined_module(eight_processes):
    plain = TinyLlama()
    plain.load_state_dict(_state(eight_processes / "pp2_tp2_fsdp2.ckpt")["state_dict"], strict=True)


@pytest.mark.slow
def test_configure_model_sees_the_mesh_with_its_tensor_parallel_dimension(eight_processes):
    held = torch.load(eight_processes / "pp2_tp2_fsdp2.rank0.pt")
    assert held["mesh"] == {"dp": DP, "pp": 2, "tp": TP}


@pytest.mark.slow
def test_each_process_holds_a_quarter_of_a_split_weight_and_half_of_a_norm(eight_processes):
    held = [torch.load(eight_processes / f"pp2_tp2_fsdp2.rank{r}.pt")["params"] for r in range(WORLD)]
    split = [n for n in held[0] if n.endswith(("q_proj.weight", "down_proj.weight"))]
    norms = [n for n in held[0] if n.endswith("input_layernorm.weight")]
    assert split and norms
    for params in held[:2]:  # pipeline rank 0 of replica 0: its two tensor-parallel processes
        for n in split:  # over tp (the plan) and over dp (FSDP)
            assert params[n]["local"] * DP * TP == params[n]["whole"]
            assert params[n]["mesh"] == ["dp", "tp"]
        for n in norms:  # over dp only
            assert params[n]["local"] * DP == params[n]["whole"]


@pytest.mark.slow
def test_a_run_resumed_across_fsdp4_then_tp2_x_fsdp2_then_one_local_stage_ends_as_uninterrupted(
    eight_processes, tmp_path
):
    module = TinyLlama()
    torch.manual_seed(123)
    trainer = ranks.quiet_trainer(PipelineStrategy(stages=1, chunks=2), 1, max_steps=3 * EPOCH,
                                  gradient_clip_val=CLIP)  # fmt: skip
    trainer.fit(module, loader(batches()), ckpt_path=eight_processes / SPLIT_SAVED)
    got = {k: v.detach() for k, v in module.state_dict().items()}
    assert max_relative_difference(got, _reference(3 * EPOCH)) < 1e-6


@pytest.mark.slow
def test_pp2_hsdp_resumed_from_fsdp4_trains_like_one_process_on_the_joined_batch(eight_processes):
    got = _state(eight_processes / "pp2_hsdp.ckpt")["state_dict"]
    expected = _reference(2 * EPOCH)
    assert sorted(got) == sorted(expected)  # DCP under the unpipelined module's keys
    assert max_relative_difference(got, expected) < 1e-5  # the clipping norm counts each element once


@pytest.mark.slow
def test_under_hsdp_each_process_holds_half_of_each_weight_shared_with_its_shard_group(eight_processes):
    from pipeckpt.engines.distributed.schedules import lookup
    from pipeckpt.engines.distributed.topology import resolve

    t = resolve(
        world=WORLD, stages=2, virtual_stages=1, dp=HDP, chunks=2, kind=lookup("1f1b"), dp_shard=SHARD
    )
    for rank in range(WORLD):
        params = torch.load(eight_processes / f"pp2_hsdp.rank{rank}.pt")["params"]
        assert params
        for held in params.values():
            assert held["local"] * SHARD == held["whole"]
            assert held["mesh"] == ["dp_replicate", "dp_shard"]
            assert held["placements"] == ["Replicate()", "Shard(dim=0)"]
            assert held["groups"] == [t.replicate_group(rank), t.shard_group(rank)]


@pytest.mark.slow
def test_under_auto_every_rank_builds_rank_zeros_choice_and_a_stage_checkpoints(eight_processes):
    held = [torch.load(eight_processes / f"pp2_tp2_fsdp2_auto.rank{r}.pt") for r in range(WORLD)]
    chosen = held[0]["chosen"]
    assert all(h["chosen"] == chosen and h["built"] == chosen for h in held)
    assert any(mode != "never" for mode in chosen), chosen  # the budget binds


@pytest.mark.slow
def test_pp2_tp2_fsdp2_under_auto_trains_like_one_process_on_the_joined_batch(eight_processes):
    got = _state(eight_processes / "pp2_tp2_fsdp2_auto.ckpt")["state_dict"]
    assert max_relative_difference(got, _reference(EPOCH)) < 1e-5  # checkpointing never changes the math


@pytest.mark.slow
def test_pp2_hsdp_x_tp2_trains_like_one_process_on_the_joined_batch(sixteen_processes):
    got = _state(sixteen_processes / "pp2_hsdp_tp2.ckpt")["state_dict"]
    expected = _reference(EPOCH)
    assert sorted(got) == sorted(expected)
    assert max_relative_difference(got, expected) < 1e-5


@pytest.mark.slow
def test_under_hsdp_x_tp_a_split_weight_is_a_quarter_per_process_and_the_rest_half(sixteen_processes):
    from pipeckpt.engines.distributed.schedules import lookup
    from pipeckpt.engines.distributed.topology import resolve

    t = resolve(
        world=HYBRID_TP_WORLD, stages=2, virtual_stages=1, dp=HDP, chunks=2, kind=lookup("1f1b"),
        tp=TP, dp_shard=SHARD,
    )  # fmt: skip
    for rank in range(HYBRID_TP_WORLD):
        params = torch.load(sixteen_processes / f"pp2_hsdp_tp2.rank{rank}.pt")["params"]
        split = {n: held for n, held in params.items() if any(key in n for key in SPLIT_BY_PLAN)}
        assert split and len(split) < len(params), sorted(params)
        tp_pair = [t.global_rank(t.replica_of(rank), t.pipeline_rank_of(rank), k) for k in range(TP)]
        for name, held in params.items():
            groups = [t.replicate_group(rank), t.shard_group(rank)]
            if name in split:
                assert held["local"] * SHARD * TP == held["whole"], name
                assert held["mesh"] == ["dp_replicate", "dp_shard", "tp"] and held["groups"] == [
                    *groups,
                    tp_pair,
                ]
            else:
                assert held["local"] * SHARD == held["whole"], name
                assert held["mesh"] == ["dp_replicate", "dp_shard"] and held["groups"] == groups
