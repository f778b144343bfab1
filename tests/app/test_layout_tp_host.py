"""On ``cluster=local`` a tensor-parallel layout pays what splitting a layer costs on this machine's
host (DTensor's dispatch), measured on the model split by its own plan over a one-process mesh
(pipeckpt/plan_tp_host.py) and priced per layer and micro-batch whatever ``tp``."""

from types import SimpleNamespace
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from support.layout_configs import llama_search
from support.local_cluster import FIGURES

from pipeckpt import plan_layout
from pipeckpt.layout import calibrate, cost
from pipeckpt.plan_tp_host import one_process_mesh, tp_host_s

pytestmark = pytest.mark.usefixtures("one_thread")


def _profile(*times: Any) -> Any:
    return SimpleNamespace(layers=[SimpleNamespace(forward_s=f, backward_s=b) for f, b in times])


def test_a_splits_host_work_is_the_mean_excess_per_layer_and_never_below_zero() -> None:
    whole = _profile((1.0, 2.0), (1.0, 2.0), (1.0, 2.0))
    split = _profile((1.3, 2.6), (1.1, 2.0), (0.9, 2.3))  # the last forward ran faster: noise, 0
    forward, backward = tp_host_s(whole, split)
    assert forward == pytest.approx((0.3 + 0.1 + 0.0) / 3)
    assert backward == pytest.approx((0.6 + 0.0 + 0.3) / 3)


def test_the_one_process_mesh_is_a_world_of_one_destroyed_after_the_block() -> None:
    assert not dist.is_initialized()
    with one_process_mesh() as mesh:
        assert mesh is not None and mesh.size() == 1 and dist.get_world_size() == 1
    assert not dist.is_initialized()


def test_no_mesh_is_opened_where_the_process_is_in_a_group_already() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        with one_process_mesh() as mesh:
            assert mesh is None
        assert dist.is_initialized() and dist.group.WORLD is group  # left as it was
    finally:
        dist.destroy_process_group()


def test_a_search_on_local_prices_the_host_work_of_an_hf_models_split_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(calibrate, "measured", lambda: dict(FIGURES))
    seen: List[Any] = []
    real_estimate = cost.estimate

    def estimate(c: Any, costs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(costs.tp_host_s)
        return real_estimate(c, costs, *args, **kwargs)

    monkeypatch.setattr(cost, "estimate", estimate)
    cfg = llama_search("cluster=local", "threads=1")
    answer = plan_layout.search_config(cfg)
    forward, backward = seen[0]
    assert forward > 0 and backward > 0 and set(seen) == {(forward, backward)}
    assert not dist.is_initialized()  # the one-process world is gone
    split = [r for r in answer.searched.ranked if r.candidate.tp > 1]
    assert split, "a 2-process world of this model has tensor-parallel layouts"
    assert torch.get_num_threads() == 1


def test_a_model_whose_heads_no_degree_of_the_world_divides_is_searched_without_a_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3 heads on 2 processes: no tensor-parallel layout, so nothing to time split (it was timed at
    # tp 2 regardless, and the model's plan refused that degree, ending the search)
    monkeypatch.setattr(calibrate, "measured", lambda: dict(FIGURES))
    answer = plan_layout.search_config(llama_search("cluster=local", "threads=1", heads=3, kv_heads=3))
    assert answer.searched.ranked and all(r.candidate.tp == 1 for r in answer.searched.ranked)
