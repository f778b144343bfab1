"""A step time no checkpoint modes can beat: what lets a search stop fitting layouts early.

Why: the fit (choosing each stage's mode under the device's memory) and the cost estimate (walking the
schedule's op order) take a tenth of a second a layout, and a thousand-GPU world has tens of
thousands of layouts, most of them far slower than the best. The estimate
(:func:`pipeckpt.layout.cost.estimate`) is a list schedule: every op waits for its rank's previous
op and for the ops it depends on, and an op's time only grows with what a mode adds (a recompute,
an offload's host copies), but for one case: a selective stage runs a zero-bubble schedule's split
backward whole, which can be cheaper than the split, so there the floor takes the cheaper of the
two. So the same ops timed with nothing recomputed, summed along paths that every run of the
schedule's order takes, bound its step from below; the paths are sums of a few per-stage times,
where the estimate walks every op. A search visiting layouts by this floor can
stop at the first whose floor is above the ``top``-th fastest step already found: every later
layout is slower, whatever modes the fit would give it (:func:`pipeckpt.layout.search.search`).
"""

import collections
import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from pipeckpt.checkpointing.modes import NEVER
from pipeckpt.layout.cluster import Cluster
from pipeckpt.layout.cost import (
    ENGINE_S_PER_MICROBATCH,
    Layout,
    laid_out,
    op_work,
    per_op_s,
    reduced_in_backward_s,
)
from pipeckpt.layout.model_costs import ModelCosts
from pipeckpt.layout.orders import rank_orders
from pipeckpt.layout.rank_work import per_rank

__all__ = ["step_floor"]


def step_floor(
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
) -> float:
    """Seconds at or below :func:`~pipeckpt.layout.cost.estimate`'s step for ``candidate`` under
    any checkpoint modes (the same arguments as there).

    The estimate's op times with nothing recomputed or offloaded, and no sends, along three paths
    that any run of the schedule's op order takes: one micro-batch's forwards through every stage and
    backwards back; per pipeline rank, from when its first op can start (FSDP's first gather, and a
    micro-batch's forwards through the stages before it) through all its ops to what follows them
    (the step's reductions and optimizer); and from its last backward through the backwards of the
    stages before it to stage 0's rank's tail. The largest of them; the rest of the estimate's
    bubble, its sends and its cores shared (a CPU) only add to it.
    """
    c = candidate
    stages = c.pp * c.virtual_stages
    _, cuts, mesh, st = laid_out(
        c, model, cluster, (NEVER,) * stages, global_batch=global_batch, seq_len=seq_len,
        precision=precision, stage_layers=stage_layers,
    )  # fmt: skip
    orders = rank_orders(c.schedule, c.pp, c.virtual_stages, c.chunks)
    start, tail, _, _, _ = per_rank(model, cluster, mesh, c, cuts, st, orders, precision)
    if reshard_after_forward:
        start = [0.0] * c.pp
    e = engine_s_per_microbatch / 2
    ranks = _rank_ops(c.schedule, c.pp, c.virtual_stages, c.chunks)
    owner = {j: r for r, mine in enumerate(ranks) for (j, _), _ in mine.through + mine.after}

    def timed(j: int, kind: str) -> float:  # cost.estimate's time of an op, nothing recomputed
        work = op_work(st[j], kind)
        return work if kind == "W" else work + e + per_op_s(st[j], work, cluster, reshard_after_forward)

    def op_s(j: int, kind: str) -> float:
        """As timed, but a split backward's passes at most what a selective stage's take: its whole
        backward in the input pass, nothing in the weight pass (cost.stage_times)."""
        if kind not in ("I", "W"):
            return timed(j, kind)
        whole, split_input = timed(j, "B"), timed(j, "I")
        inputs = min(split_input, whole)
        return inputs if kind == "I" else max(0.0, min(split_input + timed(j, "W"), whole) - inputs)

    def time_of(counts: Counts) -> float:
        return sum(n * op_s(j, k) for (j, k), n in counts)

    reach: List[float] = []  # the earliest a micro-batch's forward can start on stage j
    t = 0.0
    for j in range(stages):
        t = max(t, start[owner[j]])
        reach.append(t)
        t += op_s(j, "F")
    # after stage j's backward of a micro-batch, at least the backwards of the stages before it
    drain = [0.0]
    for j in range(stages - 1):
        drain.append(drain[-1] + min(op_s(j, "B"), op_s(j, "I")))
    # one micro-batch's forwards through every stage, then its backwards back to stage 0
    whole = t + drain[-1] + min(op_s(stages - 1, "B"), op_s(stages - 1, "I"))
    floor = whole + tail[owner[0]]
    for r, mine in enumerate(ranks):
        begin = max(start[r], reach[mine.first])
        extra = 0.0
        if reduce_every_microbatch:
            backwards = ((j, n) for (j, k), n in mine.through if k == "B")
            extra = sum((n - 1) * reduced_in_backward_s(st[j], cluster) for j, n in backwards)
        through = begin + time_of(mine.through) + extra  # its last backward (or input pass) ends
        # a rank's last backward of a micro-batch is followed by those of the stages before it,
        # none on this rank (it has no such op left), then stage 0's rank's tail
        floor = max(
            floor, through + time_of(mine.after) + tail[r], through + drain[mine.last] + tail[owner[0]]
        )
    return floor


Counts = Tuple[Tuple[Tuple[int, str], int], ...]


@dataclass(frozen=True)
class _RankOps:
    """One rank's op order as the floor reads it: the stage of its first op, the stage of its last
    backward (or input pass), how many ops of each (stage, kind) it runs up to that op and after it."""

    first: int
    last: int
    through: Counts
    after: Counts


@functools.lru_cache(maxsize=512)
def _rank_ops(schedule: str, pp: int, virtual_stages: int, chunks: int) -> Tuple[_RankOps, ...]:
    out = []
    for ops in rank_orders(schedule, pp, virtual_stages, chunks):
        end = max(n for n, (_, k, _) in enumerate(ops) if k != "W")
        through = collections.Counter((j, k) for j, k, _ in ops[: end + 1])
        after = collections.Counter((j, k) for j, k, _ in ops[end + 1 :])
        out.append(
            _RankOps(ops[0][0], ops[end][0], tuple(sorted(through.items())), tuple(sorted(after.items())))
        )
    return tuple(out)
