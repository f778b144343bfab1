"""The cost model's toy: a model of identical layers on a cluster whose rates make every term of an
estimate easy to write down by hand (tests/layout/test_cost.py and its neighbours compute against it)."""

from dataclasses import dataclass, replace
from typing import Any, Dict, Tuple

from pipeckpt.layout.cluster import Cluster, from_mapping
from pipeckpt.layout.cost import StepEstimate, estimate
from pipeckpt.layout.model_costs import ModelCosts

RATE = 1e12  # FLOP/s achieved (peak 2e12 x efficiency 0.5)
F = 1e6  # forward FLOPs per token of each layer
LAYERS = 4
PARAMS = 1000  # per layer
BPT = 8.0  # boundary bytes per token
BW = 1e9  # bytes/s, every link
HOST = 2e9
SEQ = 16
BATCH = 8
FAST = 1e30  # a link or memory so fast that its term is zero


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    tp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    schedule: str = "gpipe"
    virtual_stages: int = 1
    chunks: int = 1
    modes: Tuple[str, ...] = ()


def toy(**changes: Any) -> ModelCosts:
    m = ModelCosts(
        name="toy",
        seq_len=SEQ,
        hidden=4,
        heads=1,
        vocab=10,
        layer_flops=(F,) * LAYERS,
        layer_attention_flops=(0.0,) * LAYERS,
        layer_params=(PARAMS,) * LAYERS,
        embedding_params=0,
        head_params=0,
        head_flops=0.0,
        boundary_bytes_per_token=BPT,
        selective_share=0.25,
    )
    return replace(m, **changes)


def toy_cluster(devices: int, *, per_node: int = 0, link: float = BW, memory: float = FAST) -> Cluster:
    per_node = per_node or devices
    spec: Dict[str, Any] = {
        "name": "toy",
        "nodes": devices // per_node,
        "devices_per_node": per_node,
        "device": {
            "name": "toy",
            "memory_bytes": 2**40,
            "peak_flops": {"bf16-mixed": 2 * RATE},
            "memory_bytes_per_s": memory,
            "efficiency": 0.5,
            "host_bytes_per_s": HOST,
        },
        "intra_node_bytes_per_s": link,
        "inter_node_bytes_per_s": link / 10,
        "latency_s": 0.0,
    }
    return from_mapping(spec)


def run(layout: Layout, devices: int = 1, *, model: Any = None, **kw: Any) -> StepEstimate:
    c = kw.pop("cluster", None) or toy_cluster(devices)
    return estimate(
        layout,
        model or toy(),
        c,
        global_batch=kw.pop("global_batch", BATCH),
        seq_len=SEQ,
        precision="bf16-mixed",
        engine_s_per_microbatch=kw.pop("engine", 0.0),
        **kw,
    )


def forward_s(layers: int, tokens: int, tp: int = 1) -> float:
    return layers * F * tokens / tp / RATE
