"""The distributed engine (`engine="distributed"`) on four ranks, most of them two replicas of a
two-stage pipeline (dp x pp): a mesh with a data-parallel dimension, opened once per process however
often the same layout is fitted, and training like the local engine on all of every batch (looped
and zero-bubble schedules too, with accumulation and clipping spanning the replicas).

Slow tests start four real processes with gloo on CPU (tests/engines/distributed/distributed_worker.py),
several trainings per start, and compare the parameters with the local engine's.
"""

import json
from pathlib import Path

import pytest
from support.distributed_runs import FOUR, STEPS, ZBV_ON_REPLICAS
from support.distributed_runs import checkpoint_state as _state
from support.distributed_runs import launch as launch  # the module's fixture
from support.distributed_runs import local_strategy as _local
from support.toy import ToyModule, fit, max_relative_difference, params


@pytest.fixture(scope="module")
def four_processes(launch) -> Path:
    runs = [dict(name=n, strategy=d, depth=depth, steps=STEPS) for n, d, _, depth in FOUR]
    # the replicas' layout fitted again in the same processes: its mesh's groups are not made twice
    runs.append(dict(runs[-1], name="dp2_pp2_again", steps=1))
    runs.append(dict(ZBV_ON_REPLICAS, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05))
    return launch(4, runs)


@pytest.mark.slow
def test_replicas_of_a_pipeline_keep_a_mesh_with_a_data_parallel_dimension(four_processes):
    for rank in range(4):
        seen = json.loads((four_processes / f"dp2_pp2.rank{rank}.json").read_text())
        assert (seen["mesh"], seen["pipeline_in_default_group"]) == (["dp", "pp"], False)


@pytest.mark.slow
def test_a_process_that_fits_the_same_layout_again_opens_no_new_process_group(four_processes):
    # torch frees a mesh's groups only with the default group: made at every fit, a process
    # fitting one Trainer after another would gather a set per fit (engines/distributed/kept_groups)
    for rank in range(4):
        first = json.loads((four_processes / f"dp2_pp2.rank{rank}.json").read_text())
        again = json.loads((four_processes / f"dp2_pp2_again.rank{rank}.json").read_text())
        assert first["gloo_groups"] >= 3  # the default group, and this rank's dp and pp groups
        assert again["gloo_groups"] == first["gloo_groups"]


@pytest.mark.slow
@pytest.mark.parametrize("name, settings, local, depth", FOUR, ids=[t[0] for t in FOUR])
def test_four_processes_train_like_the_local_engine(four_processes, name, settings, local, depth):
    reference = fit(ToyModule(depth=depth), _local(**local), steps=STEPS)
    got = _state(four_processes / f"{name}.ckpt")
    assert max_relative_difference(got["state_dict"], params(reference.lightning_module)) < 1e-5


@pytest.mark.slow
def test_accumulation_and_clipping_span_replicas_that_average_after_the_step(four_processes):
    reference = fit(
        ToyModule(depth=6),
        _local(balance=[2, 1, 1, 2], chunks=4),
        steps=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
    )
    got = _state(four_processes / f"{ZBV_ON_REPLICAS['name']}.ckpt")
    assert max_relative_difference(got["state_dict"], params(reference.lightning_module)) < 1e-5
