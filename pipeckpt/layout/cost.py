"""A layout's predicted step time on a cluster: compute, recompute, the bubble, communication and the
engine's own cost, from the model's FLOPs and bytes and the cluster's rates.

Why a pure function of numbers: the search prices thousands of layouts, so nothing here touches a
tensor; the rules it applies are the project's own (the schedules' op orders from
:mod:`pipeckpt.layout.orders`, which micro-batches ``except_last`` keeps from
:func:`pipeckpt.checkpointing.order.kept`, the modes from :func:`pipeckpt.checkpointing.modes.parse_mode`,
the engine's balance by parameters, its mesh in :mod:`pipeckpt.layout.links`). docs/LAYOUT.md,
"The cost model", states every formula, constant and blind spot.
"""

import functools
import itertools
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Protocol, Sequence, Tuple

from pipeckpt._errors import config_error
from pipeckpt.checkpointing.modes import NEVER, CheckpointMode, parse_mode
from pipeckpt.checkpointing.order import kept
from pipeckpt.layout.cluster import Cluster
from pipeckpt.layout.links import Mesh, all_reduce_s, gather_s, send_s
from pipeckpt.layout.model_costs import (
    ADAMW_ELEMENTS_PER_PARAM,
    ModelCosts,
    dtype_bytes,
    model_costs_from_config,
    model_costs_from_profile,
)
from pipeckpt.layout.orders import RankOp, rank_orders, simulate
from pipeckpt.layout.rank_work import Stage, collectives, messages, per_rank, reduction_s, waited
from pipeckpt.layout.shared_cores import simulate_shared
from pipeckpt.memory.engine_cost import ENGINE_S_PER_MICROBATCH  # re-exported: the layout's default
from pipeckpt.stages.partition import min_max_partition

__all__ = [
    "ENGINE_S_PER_MICROBATCH",
    "Layout",
    "StepEstimate",
    "estimate",
    "divided",
    "balance",
    "stage_times",
    "laid_out",
    "op_work",
    "per_op_s",
    "reduced_in_backward_s",
    "ADAMW_ELEMENTS_PER_PARAM",
    # what an estimate needs of a model, from pipeckpt.layout.model_costs
    "ModelCosts",
    "model_costs_from_config",
    "model_costs_from_profile",
]


class Layout(Protocol):
    """What :func:`estimate` reads of a layout (:class:`pipeckpt.layout.candidates.Candidate`)."""

    @property
    def pp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def dp_replicate(self) -> int: ...
    @property
    def dp_shard(self) -> int: ...
    @property
    def schedule(self) -> str: ...
    @property
    def virtual_stages(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def modes(self) -> Tuple[str, ...]: ...


@dataclass(frozen=True)
class StepEstimate:
    """One optimizer step on the rank that finishes last; the parts add up to ``step_s``."""

    step_s: float
    compute_s: float  # forward and backward kernels, recompute excluded
    recompute_s: float  # forwards run again in backward (with their tensor-parallel all-reduces)
    bubble_s: float  # idle: waiting on other stages (the schedule's fill and drain)
    comm_s: float  # every collective and message of the rank, overlapped or not (at least exposed_comm_s)
    exposed_comm_s: float  # the part of it on the critical path
    engine_s: float  # the engine's own cost per micro-batch
    tokens_per_s_per_device: float
    mfu: float  # model FLOPs (no recompute) per second over the world's peak
    optimizer_s: float = 0.0  # the optimizer's step (memory-bound), and FSDP2's host work a step
    shared_s: float = 0.0  # waiting for a core, where the processes outnumber the cluster's cores


def balance(model: ModelCosts, stages: int) -> Tuple[int, ...]:
    """Layers per stage as the engine cuts them by default (``balance_by='params'``: each layer
    weighs 1 + its parameters, the largest stage made as small as it can be)."""
    if stages > model.layers:
        raise config_error(
            f"{stages} stages", f"cannot exceed the model's {model.layers} layers", "use fewer stages"
        )
    return _partition(model.layer_params, stages)


@functools.lru_cache(maxsize=256)
def _partition(layer_params: Tuple[int, ...], stages: int) -> Tuple[int, ...]:
    """The balance of ``layer_params`` over ``stages``, once per model and stage count (a search
    asks it of every layout)."""
    return tuple(min_max_partition([1 + p for p in layer_params], stages))


def estimate(
    candidate: Layout,
    model: ModelCosts,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int,
    precision: str,
    reshard_after_forward: bool = False,
    reduce_every_microbatch: bool = False,
    engine_s_per_microbatch: float = ENGINE_S_PER_MICROBATCH,
    stage_layers: Optional[Sequence[int]] = None,
) -> StepEstimate:
    """The predicted step of ``candidate`` training ``model`` on ``cluster``.

    Args:
        candidate: degrees, schedule, stages per rank, micro-batches and a mode per stage (empty:
            ``never``).
        model: the model's costs (:mod:`pipeckpt.layout.model_costs`).
        cluster: the cluster (:func:`pipeckpt.layout.cluster.cluster`), as many devices as the layout.
        global_batch: samples per optimizer step over all replicas.
        seq_len: tokens per sample.
        precision: Lightning's precision name (the device's rate and the dtypes moved).
        reshard_after_forward: FSDP frees gathered parameters after each forward (the engine's
            default is False: gathered once per step).
        reduce_every_microbatch: FSDP reduce-scatters each micro-batch's gradients in its backward
            (the engine's default is False: once, after the last micro-batch's backward).
        engine_s_per_microbatch: the engine's own cost of one micro-batch on one stage.
        stage_layers: layers per stage (default :func:`balance`).
    """
    c = candidate
    stages = c.pp * c.virtual_stages
    modes = _modes(c, stages)
    tokens, cuts, mesh, st = laid_out(
        c, model, cluster, modes, global_batch=global_batch, seq_len=seq_len, precision=precision,
        stage_layers=stage_layers,
    )  # fmt: skip
    dp, world = c.dp_replicate * c.dp_shard, cluster.world  # laid_out checked the layout uses it all
    orders = rank_orders(c.schedule, c.pp, c.virtual_stages, c.chunks)
    keep = _kept(orders)
    e = engine_s_per_microbatch / 2  # half with the forward, half with the backward (or input pass)

    def time_of(op: RankOp, *, comm: bool = True) -> float:
        j, kind, i = op
        s = st[j]
        if kind == "W":
            return s.weight_pass
        work = op_work(s, kind)
        per_op = per_op_s(s, work, cluster, reshard_after_forward) if comm else 0.0
        if kind == "F":
            return work + e + per_op
        if comm and kind == "B" and i != c.chunks - 1 and reduce_every_microbatch:
            # the gradients' reduction (the step's tail has the last micro-batch's), under the backward
            per_op += reduced_in_backward_s(s, cluster)
        redo = s.recompute if modes[j].recomputes(i, c.chunks, keep=keep[j]) else 0.0
        return work + redo + e + per_op

    act = tokens * model.boundary_bytes_per_token
    owner = {j: r for r, ops in enumerate(orders) for j, _, _ in ops}
    sends = [
        send_s(act, mesh.boundary_bytes_per_s(owner[j], owner[j + 1]), cluster.latency_s)
        for j in range(stages - 1)
    ]
    start, tail, tail_comm, optimizer, grads_comm = per_rank(
        model, cluster, mesh, c, cuts, st, orders, precision
    )
    if reshard_after_forward:
        start = [0.0] * c.pp
    ends = simulate(orders, time_of, stages=stages, send_s=lambda j: sends[j], start_s=start)
    quiet = simulate(orders, time_of, stages=stages, start_s=start) if any(sends) else ends
    finish = [ends[r] + tail[r] for r in range(c.pp)]
    r = max(range(c.pp), key=lambda k: finish[k])
    step = finish[r]
    ops = orders[r]
    compute = sum(op_work(st[j], k) for j, k, _ in ops)
    recompute = sum(
        st[j].recompute
        for j, k, i in ops
        if k in ("B", "I") and modes[j].recomputes(i, c.chunks, keep=keep[j])
    )
    per_op_comm = sum(time_of(op) - time_of(op, comm=False) for op in ops)
    engine = e * sum(1 for _, k, _ in ops if k != "W")
    busy = compute + recompute + per_op_comm + start[r] + tail_comm[r] + engine + optimizer[r]
    # the sends' share of the step: what they lengthen it by, within what the rank's own work leaves
    send_exposed = max(0.0, min(max(ends) - max(quiet), step - busy))
    exposed = per_op_comm + start[r] + tail_comm[r] + send_exposed
    bubble = max(0.0, step - busy - send_exposed)
    # processes sharing fewer cores (a CPU): the schedule run again with the cores shared among the
    # processes with work ready (pipeckpt.layout.shared_cores)
    shared = (
        max(
            0.0,
            max(
                simulate_shared(
                    orders,
                    time_of,
                    stages=stages,
                    cores=cluster.cores,
                    replicas=c.tp * dp,
                    send_s=lambda j: sends[j],
                    start_s=start,
                    tail_s=tail,
                )
            )
            - step,
        )
        if cluster.cores and world > cluster.cores
        else 0.0
    )
    step += shared
    sent = sum(messages(j, k, sends, owner) for j, k, _ in ops)
    carried = sum(st[j].tp + st[j].host for j, k, _ in ops if k != "W")  # all-reduces, host copies
    if reduce_every_microbatch:  # every backward's reduction but the last (in the tail)
        carried += sum(st[j].reduce for j, k, i in ops if k == "B" and i != c.chunks - 1)
    # at least the exposed part, which may hold sends between other stages on the step's critical path
    comm = max(exposed, carried + sent + collectives(st, ops, reshard_after_forward) + grads_comm[r])
    peak = cluster.device.peak_flops[precision]
    flops = model.model_flops_per_token(seq_len) * global_batch * seq_len
    return StepEstimate(
        step_s=step,
        compute_s=compute,
        recompute_s=recompute,
        bubble_s=bubble,
        comm_s=comm,
        exposed_comm_s=exposed,
        engine_s=engine,
        tokens_per_s_per_device=global_batch * seq_len / step / world,
        mfu=flops / (step * world * peak),
        optimizer_s=optimizer[r],
        shared_s=shared,
    )


def laid_out(
    c: Layout,
    model: ModelCosts,
    cluster: Cluster,
    modes: Sequence[CheckpointMode],
    *,
    global_batch: int,
    seq_len: int,
    precision: str,
    stage_layers: Optional[Sequence[int]] = None,
) -> Tuple[int, Tuple[int, ...], Mesh, List[Stage]]:
    """A layout on ``cluster`` as :func:`estimate` and the floor (:mod:`pipeckpt.layout.floor`)
    read it: a micro-batch's tokens, the layers per stage, the mesh, and each stage's times for one
    micro-batch under ``modes``; an error where it does not use the cluster's devices or cannot cut
    the batch evenly."""
    dp = c.dp_replicate * c.dp_shard
    world = c.pp * c.tp * dp
    if world != cluster.world:
        raise config_error(
            f"layout pp{c.pp} x tp{c.tp} x dp{dp} ({world} devices) on cluster {cluster.name!r}",
            f"the layout must use the cluster's {cluster.world} devices",
            "cut the cluster to the layout's devices (cluster(..., devices=N)) or change the degrees",
        )
    if global_batch % (dp * c.chunks):
        raise config_error(
            f"global_batch={global_batch} with dp={dp} and chunks={c.chunks}",
            "every replica cuts its share into equal micro-batches",
            f"use a global batch that is a multiple of {dp * c.chunks}",
        )
    tokens = global_batch // (dp * c.chunks) * seq_len
    cuts = tuple(stage_layers) if stage_layers is not None else balance(model, c.pp * c.virtual_stages)
    mesh = Mesh(cluster, pp=c.pp, tp=c.tp, dp_replicate=c.dp_replicate, dp_shard=c.dp_shard)
    times = stage_times(
        model, cluster, mesh, c, cuts, modes, tokens=tokens, seq_len=seq_len, precision=precision
    )
    return tokens, cuts, mesh, times


def per_op_s(s: Stage, work: float, cluster: Cluster, reshard_after_forward: bool) -> float:
    """What a forward or backward (or input pass) of ``work`` seconds adds on its rank: the
    tensor-parallel all-reduces, an offload's copy and, under ``reshard_after_forward``, the gather
    again, prefetched under its compute."""
    regather = waited(s.gather, s.gather_unit, work, cluster) if reshard_after_forward else 0.0
    return s.tp + s.host + regather


def reduced_in_backward_s(s: Stage, cluster: Cluster) -> float:
    """What a micro-batch's reduction of the stage's gradients adds to its backward
    (``reduce_every_microbatch``), run under it."""
    return waited(s.reduce, s.reduce_unit, s.backward, cluster)


def op_work(s: Stage, kind: str) -> float:
    """An op's own compute: a forward, a whole backward, or a split backward's pass."""
    return {"F": s.forward, "B": s.backward, "I": s.input_pass, "W": s.weight_pass}[kind]


def divided(unsplit: float, tp: int) -> float:
    """The share of a layer's time left on each of ``tp`` ranks when ``unsplit`` of it is not divided."""
    return unsplit + (1.0 - unsplit) / tp if tp > 1 else 1.0


def _modes(c: Layout, stages: int) -> Tuple[CheckpointMode, ...]:
    if not c.modes:
        return (NEVER,) * stages
    if len(c.modes) != stages:
        raise config_error(
            f"modes {list(c.modes)}",
            f"one checkpoint mode per stage, and there are {stages} stages",
            "give a mode per stage",
        )
    return tuple(parse_mode(m) for m in c.modes)


def _kept(orders: Sequence[Sequence[RankOp]]) -> Dict[int, FrozenSet[int]]:
    """Per stage, the micro-batches ``except_last`` keeps on its rank's order (a split backward's
    input pass is the stage's backward, its weight pass no op of the stage's activations)."""
    out = {}
    for ops in orders:
        seen = [(j, "B" if k == "I" else k, i) for j, k, i in ops if k != "W"]
        for j in {j for j, _, _ in ops}:
            out[j] = kept(seen, j)
    return out


def stage_times(
    model: ModelCosts,
    cluster: Cluster,
    mesh: Mesh,
    c: Layout,
    cuts: Sequence[int],
    modes: Sequence[CheckpointMode],
    *,
    tokens: int,
    seq_len: int,
    precision: str,
) -> List[Stage]:
    """Each stage's times for one micro-batch of ``tokens`` tokens."""
    rate = cluster.device.flops(precision)
    flops = model.flops_at(seq_len)
    act = tokens * model.boundary_bytes_per_token
    # Megatron's rule (Shoeybi et al. 2019, section 3): two all-reduces of the layer's activations
    # in its forward and two in its backward, each over the tensor-parallel group.
    one_ar = all_reduce_s(act, c.tp, mesh.tp_bytes_per_s, cluster.latency_s)
    host = cluster.device.host_bytes_per_s
    split = model.tensor_parallel
    out = []
    edges = [0, *itertools.accumulate(cuts)]
    for j, (a, b) in enumerate(itertools.pairwise(edges)):
        last = j == len(cuts) - 1
        layers = sum(flops[a:b]) * tokens * divided(split.unsplit, c.tp) / rate
        head = model.head_flops * tokens * divided(split.head_unsplit, c.tp) / rate if last else 0.0
        tp = 2 * (b - a) * one_ar
        # what a split costs the host per micro-batch whatever tp (ModelCosts.tensor_parallel)
        forward_host, backward_host = (
            ((b - a) * s + (h if last else 0.0) for s, h in zip(split.host_s, split.head_host_s, strict=True))
            if c.tp > 1
            else (0.0, 0.0)
        )
        mode = modes[j]
        share = 0.0 if not mode.checkpoints else model.selective_share if mode.selective else 1.0
        params = sum(model.layer_params[a:b]) / c.tp * dtype_bytes(precision)
        gather = cluster.all_gather_factor * gather_s(
            params, c.dp_shard, mesh.shard_bytes_per_s, cluster.latency_s * (b - a)
        )
        # a micro-batch's reduction of the stage's gradients, priced as the step's (rank_work.per_rank)
        reduce = reduction_s(sum(model.layer_params[a:b]) / c.tp, c, mesh, cluster, precision, b - a)
        backward = model.backward_factor * (layers + head) + backward_host
        # a selective stage does not split (torch's checkpoint recomputes once: docs/DESIGN.md)
        inputs, weights = (
            (backward, 0.0) if mode.selective else model.split_backward.at(backward, first=j == 0)
        )
        out.append(
            Stage(
                forward=layers + head + forward_host,
                backward=backward,
                tp=tp,
                recompute=share * (layers + tp + forward_host),
                host=act / host if mode.offloads and host > 0 else 0.0,
                gather=gather,
                gather_unit=gather / max(1, b - a),
                reduce=reduce,
                reduce_unit=reduce / max(1, b - a),
                input_pass=inputs,
                weight_pass=weights,
            )
        )
    return out
