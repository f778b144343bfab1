"""On ``cluster=local`` a tensor-parallel layout pays what splitting a layer costs on this machine:
the model split by its own plan over real processes and timed beside the unsplit model at two
micro-batch sizes (pipeckpt/plan_tp_host.py), fitted as the share ``tp`` does not divide and the
host's fixed seconds per layer and micro-batch."""

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from support.layout_configs import llama_search
from support.local_cluster import FIGURES, priced_costs

from pipeckpt import plan_layout
from pipeckpt.layout import calibrate
from pipeckpt.plan_shapes import SearchShapes
from pipeckpt.plan_tp_host import fit

pytestmark = pytest.mark.usefixtures("one_thread")


def _times(
    share: float, host: float, head_share: float, head_host: float, comm: Any
) -> Dict[str, List[float]]:
    """Times as plan_tp_host.timed_pair gives them: a whole layer of 1 ms forward and 2 ms backward
    per sample (outside: 3 and 5), the split one at ``share`` of it plus ``host`` and the all-reduces."""
    out = {}
    for m in (8, 16):
        whole = [1e-3 * m, 2e-3 * m, 3e-3 * m, 5e-3 * m]
        out[f"whole {m}"] = whole
        out[f"split {m}"] = [
            share * whole[0] + host + comm(m),
            share * whole[1] + 2 * host + comm(m),
            head_share * whole[2] + head_host,
            head_share * whole[3] + head_host,
        ]
    return out


def test_the_fit_finds_the_share_tp_leaves_whole_and_the_hosts_seconds_less_the_all_reduces() -> None:
    comm = lambda m: 1e-4 * m  # noqa: E731  counted apart by the cost model: taken out
    # at tp 2 a rank runs 0.75 of the layer: half of it is not divided (0.5 + 0.5 / 2)
    got = fit(_times(0.75, 4e-3, 1.0, 1e-3, comm), 2, (8, 16), comm)
    assert got.unsplit == pytest.approx(0.5)
    assert got.host_s == pytest.approx((4e-3, 8e-3))
    assert got.head_unsplit == pytest.approx(1.0) and got.head_host_s == pytest.approx((1e-3, 1e-3))


def test_the_fit_clamps_noise_to_a_share_in_0_1_and_host_seconds_of_at_least_0() -> None:
    none = lambda m: 0.0  # noqa: E731
    faster = fit(_times(0.4, -1e-3, 1.3, 0.0, none), 2, (8, 16), none)  # below 1/tp; above whole
    assert faster.unsplit == 0.0 and faster.host_s == (0.0, 0.0)
    assert faster.head_unsplit == 1.0


def test_no_split_is_timed_where_the_process_is_in_a_group_already() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = llama_search("cluster=local", "threads=1")
        with plan_layout.contextlib.ExitStack() as stack:
            shapes = SearchShapes(cfg, plan_layout.batch(cfg), stack, fake=True)
            shapes._rooted = True
            assert shapes.timed_split(8, 2) is None
        assert dist.is_initialized()  # left as it was
    finally:
        dist.destroy_process_group()


def test_a_search_on_local_prices_the_host_work_of_an_hf_models_split_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    priced = priced_costs(monkeypatch)
    cfg = llama_search("cluster=local", "threads=1")
    answer = plan_layout.search_config(cfg)
    seen = [costs.tensor_parallel for costs in priced]
    measured = seen[0]
    assert set(seen) == {measured}  # measured once, for every layout
    assert 0.0 <= measured.unsplit <= 1.0 and 0.0 <= measured.head_unsplit <= 1.0
    assert measured.host_s[0] + measured.host_s[1] > 0  # DTensor's dispatch is never free on a CPU
    assert not dist.is_initialized()  # the measuring processes' world was their own
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
