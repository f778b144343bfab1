"""Replicas that shard nothing (``data_parallel='ddp'``, ``dp > 1``) as the cost model prices their
gradients' reduction (pipeckpt/layout/replicas.py), by the engine's two ways of keeping them: under
DDP, which reduces under the last micro-batch's backward (a Sequential's, under a schedule that does
not split); averaged after the step, under no backward (a ``pipeline_of`` model's, and a
Sequential's under a split schedule, whose input passes never arm DDP's reducer)."""

from dataclasses import replace

import pytest
from support.toy_costs import BATCH, BW, LAYERS, PARAMS, Layout, run, toy, toy_cluster

from pipeckpt.layout.replicas import reduced_after_step, replicated
from pipeckpt.layout.split_backward import SplitBackward

WHOLE_ALL_REDUCE = 2 * (2 - 1) / 2 * LAYERS * PARAMS * 4 / BW  # float32 gradients over 2 replicas
ZBV = Layout(pp=2, schedule="zbv_zero_bubble", virtual_stages=2, chunks=4)


def test_replicas_are_whole_copies_only_where_nothing_is_sharded_or_split_over_tp() -> None:
    assert replicated(Layout(dp_replicate=2))
    assert not replicated(Layout())
    assert not replicated(Layout(dp_shard=2)) and not replicated(Layout(dp_replicate=2, dp_shard=2))
    assert not replicated(Layout(dp_replicate=2, tp=2))  # FSDP2 at shard 1: DDP takes no DTensor


def test_which_replicas_average_after_the_step() -> None:
    ddp = Layout(dp_replicate=2)
    assert reduced_after_step(ddp, module_pipeline=True)
    assert not reduced_after_step(ddp, module_pipeline=False)
    assert reduced_after_step(replace(ZBV, dp_replicate=2), module_pipeline=False)
    assert not reduced_after_step(
        replace(ZBV, dp_replicate=2, schedule="interleaved_1f1b"), module_pipeline=False
    )
    assert not reduced_after_step(replace(ddp, dp_shard=2, dp_replicate=1), module_pipeline=True)


def test_a_module_pipelines_replicas_wait_for_their_whole_all_reduce_after_the_step() -> None:
    layout = Layout(dp_replicate=2, chunks=2)
    after = run(layout, 2, model=toy(module_pipeline=True))
    assert after.exposed_comm_s == pytest.approx(WHOLE_ALL_REDUCE)
    ddp = run(layout, 2)  # DDP's reduction runs under the last micro-batch's backward
    assert ddp.comm_s == pytest.approx(WHOLE_ALL_REDUCE) and ddp.exposed_comm_s < WHOLE_ALL_REDUCE
    assert after.step_s - ddp.step_s == pytest.approx(WHOLE_ALL_REDUCE - ddp.exposed_comm_s)


def test_a_sequentials_replicas_under_a_split_schedule_wait_for_theirs_too() -> None:
    layout = replace(ZBV, dp_replicate=2)
    sequential = run(layout, 4, global_batch=2 * BATCH)
    module = run(layout, 4, model=toy(module_pipeline=True), global_batch=2 * BATCH)
    assert sequential.step_s == pytest.approx(module.step_s)
    assert sequential.exposed_comm_s >= WHOLE_ALL_REDUCE / 2  # a rank's half of the layers, none hidden


def test_replicas_that_average_after_the_step_split_as_one_replica_does() -> None:
    # two replicas of half the batch each: the same micro-batch as one replica of the whole batch
    model = toy(split_backward=SplitBackward(input_share=0.75, factor=1.2))
    replicas = run(replace(ZBV, dp_replicate=2), 4, model=model, global_batch=2 * BATCH)
    assert replicas.compute_s == pytest.approx(run(ZBV, 2, model=model).compute_s)


def test_without_overlap_both_ways_wait_for_the_whole_all_reduce() -> None:
    serial = replace(toy_cluster(2), overlaps=False)
    layout = Layout(dp_replicate=2, chunks=2)
    ddp, after = (
        run(layout, 2, cluster=serial),
        run(layout, 2, cluster=serial, model=toy(module_pipeline=True)),
    )
    assert after.step_s == pytest.approx(ddp.step_s)
