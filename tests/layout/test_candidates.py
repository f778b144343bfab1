"""The layouts the search enumerates: the engine's own rules, counted exactly."""

from dataclasses import replace

import pytest

from pipeckpt import PipeckptConfigError
from pipeckpt.engines.distributed.schedules import lookup, microbatch_rule
from pipeckpt.engines.distributed.topology import resolve
from pipeckpt.layout.candidates import (
    SCHEDULES,
    Candidate,
    Model,
    candidates,
    chunk_counts,
    degrees,
    virtual_stage_counts,
)
from pipeckpt.settings import PipeSettings


def test_the_seven_schedules_are_the_engines_proven_ones() -> None:
    proven = {
        "ScheduleGPipe",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
        "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
        "ScheduleDualPipeV",
    }
    assert {lookup(s).cls.__name__ for s in SCHEDULES} == proven


def test_degrees_multiply_to_the_world() -> None:
    found = list(degrees(8, Model(layers=8, heads=8, tensor_parallel=True)))
    assert all(pp * tp * r * s == 8 for pp, tp, r, s in found)
    assert len(found) == len(set(found))


def test_degrees_of_a_world_of_four_without_tensor_parallelism() -> None:
    found = sorted(degrees(4, Model(layers=6, heads=4, tensor_parallel=False)))
    # pp 1: dp 4 as (4, 1), (2, 2), (1, 4); pp 2: dp 2 as (2, 1), (1, 2); pp 4: (1, 1)
    assert found == [(1, 1, 1, 4), (1, 1, 2, 2), (1, 1, 4, 1), (2, 1, 1, 2), (2, 1, 2, 1), (4, 1, 1, 1)]


def test_tensor_parallel_degree_divides_heads_and_kv_heads() -> None:
    tps = {tp for _, tp, _, _ in degrees(16, Model(layers=32, heads=32, kv_heads=2, tensor_parallel=True))}
    assert tps == {1, 2}


def test_tensor_parallel_groups_stay_within_a_node() -> None:
    # 3 nodes of 8 devices, a 96-head model: tp 3, 6, 12 and 24 divide the heads and the world but not
    # a node's 8 devices, so some of their groups would span two nodes
    model = Model(layers=80, heads=96, tensor_parallel=True)
    assert {tp for _, tp, _, _ in degrees(24, model)} == {1, 2, 3, 4, 6, 8, 12, 24}
    assert {tp for _, tp, _, _ in degrees(24, model, devices_per_node=8)} == {1, 2, 4, 8}


def test_pipeline_degree_never_exceeds_the_layers() -> None:
    pps = {pp for pp, _, _, _ in degrees(8, Model(layers=3))}
    assert pps == {1, 2}


def test_virtual_stages_per_schedule() -> None:
    assert virtual_stage_counts("1f1b", 2, 8) == [1]
    assert virtual_stage_counts("zbv_zero_bubble", 2, 8) == [2]
    assert virtual_stage_counts("interleaved_1f1b", 2, 8) == [2, 3, 4]
    assert virtual_stage_counts("interleaved_1f1b", 2, 5) == [2]
    assert virtual_stage_counts("interleaved_1f1b", 1, 8) == []


def test_chunks_divide_the_replica_batch_and_meet_the_schedules_rule() -> None:
    assert chunk_counts("gpipe", pp=4, virtual_stages=1, replica_batch=12) == [1, 2, 3, 4, 6, 12]
    assert chunk_counts("1f1b", pp=4, virtual_stages=1, replica_batch=12) == [4, 6, 12]
    # DualPipeV needs a micro-batch per stage: 2 x pp stages
    assert chunk_counts("dual_pipe_v", pp=2, virtual_stages=2, replica_batch=8) == [4, 8]


def test_every_candidate_is_a_topology_the_engine_resolves() -> None:
    found = candidates(4, Model(layers=6, heads=4), global_batch=16)
    assert len(found) > 20
    for c in found:
        s = PipeSettings(**c.settings())
        topology = resolve(
            world=4,
            stages=s.stages,
            virtual_stages=c.virtual_stages,
            dp=s.dp,
            chunks=c.chunks,
            kind=lookup(c.schedule),
            tp=c.tp,
            dp_shard=s.dp_shard,
        )
        assert (topology.pp, topology.dp, topology.stages) == (c.pp, c.dp, c.stages)
        assert microbatch_rule(lookup(c.schedule), c.chunks, c.pp, c.stages) is None


def test_a_single_rank_pipeline_is_listed_under_gpipe_only() -> None:
    found = candidates(2, Model(layers=4), global_batch=4)
    assert {c.schedule for c in found if c.pp == 1} == {"gpipe"}


def test_data_parallel_degree_divides_the_global_batch() -> None:
    found = candidates(4, Model(layers=4), global_batch=2)
    assert {c.dp for c in found} == {1, 2}


def test_settings_of_a_hybrid_sharded_tensor_parallel_layout() -> None:
    c = Candidate(pp=2, tp=2, dp_replicate=2, dp_shard=2, schedule="1f1b", virtual_stages=1, chunks=4)
    s = c.settings()
    assert (s["dp"], s["dp_shard"], s["data_parallel"], s["tensor_parallel"], s["stages"]) == (
        4,
        2,
        "fsdp",
        2,
        2,
    )
    assert c.world == 16


def test_a_layout_sharded_by_fsdp_is_listed_kept_gathered_and_resharded_after_forward() -> None:
    found = candidates(4, Model(layers=4), global_batch=8)
    sharded = [c for c in found if c.dp_shard > 1]
    assert sharded and {c.reshard for c in sharded} == {False, True}
    assert not any(c.reshard for c in found if c.dp_shard == 1)  # nothing gathered to free
    kept, freed = (
        [
            (c.pp, c.tp, c.dp_replicate, c.dp_shard, c.schedule, c.virtual_stages, c.chunks)
            for c in sharded
            if c.reshard == r
        ]
        for r in (False, True)
    )
    assert kept == freed  # every sharded layout both ways
    c = next(c for c in sharded if c.reshard)
    assert PipeSettings(**c.settings()).reshard_after_forward is True
    assert c.describe().endswith(f"(fsdp {c.dp_shard}, reshard)")
    assert "reshard_after_forward" not in next(c for c in found if c.dp_shard == 1).settings()


def test_a_sharded_layout_of_several_micro_batches_is_listed_reducing_once_and_every_micro_batch() -> None:
    found = candidates(4, Model(layers=4), global_batch=8)
    every = [c for c in found if c.reduce_every]
    assert every and all(c.dp_shard > 1 and c.chunks > 1 for c in every)
    assert not any(lookup(c.schedule).traits.split_backward for c in every)  # refused by the engine
    twins = {replace(c, reduce_every=False) for c in every}
    expected = {
        c
        for c in found
        if c.dp_shard > 1
        and c.chunks > 1
        and not c.reduce_every
        and not lookup(c.schedule).traits.split_backward
    }
    assert twins == expected  # each such layout both ways
    c = every[0]
    assert PipeSettings(**c.settings()).reduce_every_microbatch is True
    assert c.describe().endswith("reduce every)")


def test_an_unknown_schedule_is_refused_by_name() -> None:
    with pytest.raises(PipeckptConfigError, match="schedule='zigzag'"):
        candidates(2, Model(layers=4), global_batch=4, schedules=["zigzag"])
