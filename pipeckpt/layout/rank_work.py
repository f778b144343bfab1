"""What one pipeline rank's stages cost beyond their kernels: FSDP's gathers and reduce-scatters, the
data-parallel all-reduces, the optimizer step, and the messages its ops send, with what of them
the step waits for.

Why apart from :mod:`pipeckpt.layout.cost`: the estimate walks the schedule's op order; these are
the per-rank terms it adds before the rank's first op and after its last, priced from the mesh's
links (:mod:`pipeckpt.layout.links`) and the cluster's overlap.
"""

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from pipeckpt.engines.distributed.tensor_parallel import under_fsdp
from pipeckpt.layout.cluster import Cluster
from pipeckpt.layout.links import Mesh, all_reduce_s, gather_s
from pipeckpt.layout.model_costs import ADAMW_ELEMENTS_PER_PARAM, ModelCosts, dtype_bytes
from pipeckpt.layout.orders import RankOp
from pipeckpt.layout.replicas import reduced_after_step

__all__ = ["Stage", "per_rank", "reduction_s", "waited", "messages", "collectives", "sharded_collectives_s"]


@dataclass(frozen=True)
class Stage:
    forward: float  # compute of one micro-batch's forward (head included on the last stage)
    backward: float
    tp: float  # tensor-parallel all-reduces of one forward (and again of one backward)
    recompute: float  # one recomputed micro-batch
    host: float  # offload: one direction of the stage input over the host link
    gather: float  # FSDP's all-gather of the stage's parameters
    gather_unit: float
    input_pass: float  # a split backward's input pass (layout.split_backward)
    weight_pass: float  # and its weight pass
    reduce: float = 0.0  # FSDP's reduction of the stage's gradients (reduction_s)
    reduce_unit: float = 0.0  # and one layer's share of it


def grad_bytes(precision: str) -> int:
    """Bytes of a reduced gradient element: float32 under mixed precision (FSDP's reduce dtype is
    the parameters' master dtype, docs/DISTRIBUTED.md), else the compute dtype."""
    return 4 if precision.endswith("-mixed") or precision.startswith("32") else dtype_bytes(precision)


def per_rank(
    model: ModelCosts,
    cluster: Cluster,
    mesh: Mesh,
    c: Any,  # the layout (pipeckpt.layout.cost.Layout: degrees, schedule, chunks)
    cuts: Sequence[int],
    st: Sequence[Stage],
    orders: Sequence[Sequence[RankOp]],
    precision: str,
) -> Tuple[List[float], List[float], List[float], List[float], List[float]]:
    """Per pipeline rank: when it may start (FSDP's first all-gather, prefetched under the first
    forward), what it adds after its last op (gradient reduce-scatter and all-reduces, overlapped with
    the last micro-batch's backward except the last unit's, or not at all where the replicas average
    after the step; the embedding's all-reduce, whose gradient is made last, not at all; the
    optimizer step, FSDP2's host work a step with it), of that the communication, the optimizer, and
    the gradients' collectives whole (overlapped or not)."""
    lat = cluster.latency_s
    grad = grad_bytes(precision)
    master = 4 if precision.endswith("-mixed") or precision.startswith("32") else dtype_bytes(precision)
    edges = [0, *itertools.accumulate(cuts)]
    after_step = reduced_after_step(c, module_pipeline=model.module_pipeline)
    starts, tails, comms, opts, wholes = [], [], [], [], []
    for ops in orders:
        mine = sorted({j for j, _, _ in ops})
        units = sum(cuts[j] for j in mine)
        params = sum(sum(model.layer_params[edges[j] : edges[j + 1]]) for j in mine) / c.tp
        first = ops[0][0] if ops else 0
        gather = sum(st[j].gather for j in mine)
        unit = gather / max(1, units)
        starts.append(waited(gather, unit, st[first].forward, cluster))
        dp = c.dp_replicate * c.dp_shard
        head = model.head_params / c.tp if len(cuts) - 1 in mine else 0.0
        emb = model.embedding_params / c.tp if 0 in mine else 0.0
        ar_head = all_reduce_s(head * grad, dp, mesh.dp_bytes_per_s, lat)
        ar_emb = all_reduce_s(emb * grad, dp, mesh.dp_bytes_per_s, lat)
        overlapped = reduction_s(params, c, mesh, cluster, precision, units) + ar_head
        last = ops[-1][0] if ops else 0
        if after_step:  # under no backward (layout.replicas)
            comm = overlapped + ar_emb
        else:
            comm = waited(overlapped, overlapped / max(1, units), st[last].backward, cluster) + ar_emb
        held = params / c.dp_shard + head + emb
        opt = held * ADAMW_ELEMENTS_PER_PARAM * master / cluster.device.memory_bytes_per_s
        if under_fsdp(c.dp_shard, c.tp):  # FSDP2's host work (ModelCosts.fsdp_host), with the optimizer's
            opt += units * model.fsdp_host.step_s
        tails.append(comm + opt)
        comms.append(comm)
        opts.append(opt)
        wholes.append(overlapped + ar_emb)
    return starts, tails, comms, opts, wholes


def reduction_s(params: float, c: Any, mesh: Mesh, cluster: Cluster, precision: str, units: int) -> float:
    """FSDP's reduction of the gradients of ``params`` elements in ``units`` units: their
    reduce-scatter over the shard group (x the cluster's factor, a latency per unit), then, under
    HSDP, the all-reduce of the shards across the replicas."""
    grad, lat = grad_bytes(precision), cluster.latency_s
    rs = cluster.reduce_scatter_factor * gather_s(
        params * grad, c.dp_shard, mesh.shard_bytes_per_s, lat * units
    )
    return rs + all_reduce_s(params / c.dp_shard * grad, c.dp_replicate, mesh.replicate_bytes_per_s, lat)


def waited(whole: float, unit: float, under: float, cluster: Cluster) -> float:
    """What of ``whole`` seconds of collectives the step waits for when all but the first (or
    last) ``unit`` run under ``under`` seconds of compute; all of it where the cluster cannot run
    communication beside compute (:attr:`Cluster.overlaps`)."""
    if not cluster.overlaps:
        return whole
    return unit + max(0.0, whole - unit - under)


def messages(j: int, kind: str, sends: Sequence[float], owner: Dict[int, int]) -> float:
    """Seconds of the messages an op's rank sends and receives for it: a forward receives from the
    previous stage and sends to the next, a backward (or input pass) the other way; none between two
    stages of one rank, none for a weight pass."""
    if kind == "W":
        return 0.0
    out = 0.0
    for a in (j - 1, j):  # boundary a joins stages a and a + 1
        if 0 <= a < len(sends) and owner[a] != owner[a + 1]:
            out += sends[a]
    return out


def collectives(st: Sequence[Stage], ops: Sequence[RankOp], reshard: bool) -> float:
    """FSDP's all-gathers a rank runs in a step, overlapped or not."""
    mine = {j for j, _, _ in ops}
    if not reshard:
        return sum(st[j].gather for j in mine)
    return sum(st[j].gather for j, k, _ in ops if k in ("F", "B", "I"))


def sharded_collectives_s(model: ModelCosts, cluster: Cluster, shard: int, precision: str) -> float:
    """What FSDP's collectives add to a step over DDP's, every layer over ``shard`` ranks of one node
    of ``cluster``, priced as a layout's are (a stage's all-gather in :mod:`pipeckpt.layout.cost`,
    the reduce-scatter and all-reduce in :func:`per_rank`), none overlapped: what a measurement of
    FSDP's host work against DDP takes out."""
    mesh = Mesh(cluster, pp=1, tp=1, dp_replicate=1, dp_shard=shard)
    params, lat = sum(model.layer_params), cluster.latency_s * model.layers
    gather = gather_s(params * dtype_bytes(precision), shard, mesh.shard_bytes_per_s, lat)
    scatter = gather_s(params * grad_bytes(precision), shard, mesh.shard_bytes_per_s, lat)
    reduce = all_reduce_s(params * grad_bytes(precision), shard, mesh.shard_bytes_per_s, cluster.latency_s)
    return cluster.all_gather_factor * gather + cluster.reduce_scatter_factor * scatter - reduce
