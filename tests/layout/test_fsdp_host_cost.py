"""FSDP2's host work (``ModelCosts.fsdp_host``, measured on ``local`` by pipeckpt/plan_fsdp_host.py) in
a layout's step: seconds a step per sharded layer on the rank, counted with its optimizer step, on
the toy of tests/support/toy_costs.py, against a hand computation."""

from dataclasses import replace

import pytest
from support.toy_costs import LAYERS, Layout, run, toy, toy_cluster

from pipeckpt.layout.model_costs import FsdpHostCosts

STEP = 3e-3  # per sharded layer
HOSTED = toy(fsdp_host=FsdpHostCosts(step_s=STEP))


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_sharded_rank_pays_its_layers_host_work_once_a_step(chunks: int) -> None:
    plain = run(Layout(dp_shard=2, chunks=chunks), 2)
    hosted = run(Layout(dp_shard=2, chunks=chunks), 2, model=HOSTED)
    assert hosted.optimizer_s - plain.optimizer_s == pytest.approx(LAYERS * STEP)
    assert hosted.step_s - plain.step_s == pytest.approx(LAYERS * STEP)


def test_hybrid_sharding_pays_it_too() -> None:
    plain, hosted = (
        run(Layout(dp_replicate=2, dp_shard=2), 4),
        run(Layout(dp_replicate=2, dp_shard=2), 4, model=HOSTED),
    )
    assert hosted.step_s - plain.step_s == pytest.approx(LAYERS * STEP)


def test_layouts_that_do_not_shard_pay_none_of_it() -> None:
    unsharded = ((Layout(chunks=2), 1), (Layout(dp_replicate=2, chunks=2), 2), (Layout(pp=2, chunks=2), 2))
    for layout, devices in unsharded:
        assert run(layout, devices, model=HOSTED).step_s == pytest.approx(run(layout, devices).step_s)


def test_each_pipeline_rank_pays_for_its_own_layers_only() -> None:
    # pp2 x fsdp 2: a rank holds half the layers; the step is the last rank's, which pays its half
    quiet = replace(toy_cluster(4), overlaps=False)
    plain = run(Layout(pp=2, dp_shard=2), 4, cluster=quiet)
    hosted = run(Layout(pp=2, dp_shard=2), 4, cluster=quiet, model=HOSTED)
    assert hosted.optimizer_s - plain.optimizer_s == pytest.approx(LAYERS // 2 * STEP)
    assert hosted.step_s - plain.step_s == pytest.approx(LAYERS // 2 * STEP)


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_the_parts_still_add_up_to_the_step(schedule: str, v: int) -> None:
    layout = Layout(pp=2, dp_shard=2, schedule=schedule, virtual_stages=v, chunks=4)
    for reshard in (False, True):
        e = run(layout, 4, model=HOSTED, engine=1e-4, reshard_after_forward=reshard)
        parts = e.compute_s + e.recompute_s + e.bubble_s + e.exposed_comm_s + e.engine_s + e.optimizer_s
        assert parts == pytest.approx(e.step_s)
        assert e.optimizer_s >= LAYERS // 2 * STEP and e.bubble_s >= 0


def test_tensor_parallelism_pays_it_at_a_shard_degree_of_1() -> None:
    # the engine runs a tensor-parallel stage under FSDP2 whatever its shard degree
    plain, hosted = run(Layout(tp=2), 2), run(Layout(tp=2), 2, model=HOSTED)
    assert hosted.optimizer_s - plain.optimizer_s == pytest.approx(LAYERS * STEP)
