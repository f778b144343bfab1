"""On ``cluster=local`` a sharded layout pays what FSDP2 costs the host on this machine: the model's
training step timed sharded and under DDP over real processes (pipeckpt/plan_fsdp_host.py), less
the collectives the cost model prices apart, spread over the layers it shards as seconds a step."""

from typing import Dict

import pytest
import torch.distributed as dist
from support.layout_configs import llama_search
from support.local_cluster import priced_costs

from pipeckpt import plan_layout
from pipeckpt.layout.model_costs import FsdpHostCosts
from pipeckpt.plan_fsdp_host import fit
from pipeckpt.plan_shapes import SearchShapes

pytestmark = pytest.mark.usefixtures("one_thread")


def _times(host: float, comm: float) -> Dict[str, float]:
    """Steps as plan_fsdp_host.timed gives them: 1 s under DDP, and sharded that plus the host's
    seconds and the collectives' (once a step), the second micro-batch count noisier."""
    return {
        "whole 1": 1.0,
        "sharded 1": 1.0 + host + comm - 0.01,
        "whole 2": 1.0,
        "sharded 2": 1.0 + host + comm + 0.01,
    }


def test_the_fit_takes_the_collectives_out_and_spreads_the_rest_over_the_layers() -> None:
    assert fit(_times(0.08, 0.03), 4, 0.03).step_s == pytest.approx(0.02)


def test_the_fit_clamps_noise_to_at_least_0() -> None:
    # collectives priced above what the sharded step measured over DDP's
    assert fit(_times(0.01, 0.0), 2, 0.5) == FsdpHostCosts(0.0)


def test_no_step_is_timed_where_the_process_is_in_a_group_already() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = llama_search("cluster=local", "threads=1")
        with plan_layout.contextlib.ExitStack() as stack:
            assert SearchShapes(cfg, plan_layout.batch(cfg), stack, fake=True).timed_fsdp(2) is None
        assert dist.is_initialized()  # left as it was
    finally:
        dist.destroy_process_group()


def test_a_search_on_local_prices_fsdps_host_work_measured_on_its_own_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    priced = priced_costs(monkeypatch)
    answer = plan_layout.search_config(llama_search("cluster=local", "threads=1"))
    seen = {costs.fsdp_host for costs in priced}
    assert len(seen) == 1  # measured once, for every layout
    [measured] = seen
    assert measured.step_s > 0  # DTensor's dispatch is never free on a CPU
    assert not dist.is_initialized()  # the measuring processes' world was their own
    assert any(r.candidate.dp_shard > 1 for r in answer.searched.ranked)
