"""Each pipeline rank's ops under a schedule, and the step's length when they run with given times.

Why the schedules' own orders: the bubble is what the op order leaves idle, and a closed formula
(``(p - 1) / m`` of the compute for GPipe and 1F1B, ``/ v`` interleaved) holds only for equal stages
and no communication. The single-stage schedules' orders are the engines' (:func:`pipeckpt.memory.
schedule.op_order`); the looped ones are torch's own ``pipeline_order``, computed by the schedule
class's per-rank rule without building live stages (torch's private ``_calculate_single_rank_operations``,
read here as the schedule computes it for every rank at construction). The simulation generalises
:func:`pipeckpt.memory.predict._makespan` to several stages per rank, split backwards and send times.
"""

import functools
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch.distributed.pipelining import schedules as torch_schedules

from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.schedules import lookup, microbatch_rule
from pipeckpt.memory.schedule import op_order

__all__ = ["RankOp", "rank_orders", "simulate", "dependencies", "ready_at"]

RankOp = Tuple[int, str, int]  # (stage, "F" | "B" | "I" | "W", micro-batch)


@functools.lru_cache(maxsize=512)
def rank_orders(schedule: str, pp: int, virtual_stages: int, chunks: int) -> Tuple[Tuple[RankOp, ...], ...]:
    """Each pipeline rank's compute ops in the order it runs them.

    Args:
        schedule: a schedule the distributed engine runs (any spelling :func:`lookup` takes).
        pp: pipeline ranks.
        virtual_stages: stages per rank (1 unless the schedule is looped).
        chunks: micro-batches per step.
    """
    kind = lookup(schedule)
    problem = microbatch_rule(kind, chunks, pp, pp * virtual_stages)
    if problem:
        raise config_error(f"chunks={chunks} with schedule={schedule!r} on pp={pp}", problem, "change chunks")
    if kind.looped and (virtual_stages < 2 or (kind.traits.v_shape and virtual_stages != 2)):
        raise config_error(
            f"virtual_stages={virtual_stages} with schedule={schedule!r}",
            "a looped schedule runs at least 2 stages per rank (a V-shaped one exactly 2)",
            "set virtual_stages accordingly",
        )
    if not kind.looped:
        if virtual_stages != 1:
            raise config_error(
                f"virtual_stages={virtual_stages} with schedule={schedule!r}",
                "only a looped schedule runs several stages per rank",
                "use virtual_stages=1",
            )
        name = "1f1b" if kind.cls.__name__ == "Schedule1F1B" else "gpipe"
        order, _ = op_order(name, stages=pp, microbatches=chunks)
        return tuple(tuple((j, k, i) for k, i in ops) for j, ops in enumerate(order))
    return _looped(kind.cls, pp, virtual_stages, chunks, v_shape=kind.traits.v_shape)


def _looped(cls: Any, pp: int, v: int, m: int, *, v_shape: bool) -> Tuple[Tuple[RankOp, ...], ...]:
    """A looped schedule's ``pipeline_order`` from the class's own per-rank rule: the attributes its
    constructor sets before computing it, set here from the three counts."""
    rounds = max(1, m // pp)
    style = "v" if v_shape else "loop"
    state = SimpleNamespace(
        pp_group_size=pp,
        n_local_stages=v,
        _n_microbatches=m,
        _num_stages=pp * v,
        num_stages=pp * v,
        number_of_rounds=rounds,
        microbatches_per_round=m // rounds,
        _stages=[None] * v,
        stage_index_to_group_rank=torch_schedules.generate_stage_to_rank_mapping(pp, pp * v, style=style),
    )
    order: Dict[int, List[Any]] = {}
    for rank in range(pp):
        state.rank = rank
        order[rank] = cls._calculate_single_rank_operations(_Bound(cls, state), rank)
    if hasattr(cls, "_add_bubbles_to_actions") and cls.__name__ == "ScheduleInterleavedZeroBubble":
        state.pipeline_order = order
        order = cls._add_bubbles_to_actions(_Bound(cls, state), v * pp)
    return tuple(tuple(_flat(order[r])) for r in range(pp))


class _Bound:
    """``state``'s attributes with ``cls``'s methods, as the schedule's own ``self`` would offer."""

    def __init__(self, cls: Any, state: SimpleNamespace) -> None:
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_state", state)

    def __getattr__(self, name: str) -> object:
        state = object.__getattribute__(self, "_state")
        if hasattr(state, name):
            return getattr(state, name)
        attr = getattr(object.__getattribute__(self, "_cls"), name)
        return attr.__get__(self) if callable(attr) and hasattr(attr, "__get__") else attr

    def __setattr__(self, name: str, value: object) -> None:
        setattr(object.__getattribute__(self, "_state"), name, value)


def _flat(actions: Sequence[Any]) -> List[RankOp]:
    out: List[RankOp] = []
    for a in actions:
        if a is None:
            continue
        subs = getattr(a, "sub_actions", None)
        if subs:
            out.extend(_flat(subs))
            continue
        kind = str(a.computation_type.value)
        i = a.microbatch_index
        if kind in ("F", "B", "I", "W") and i is not None:
            out.append((int(a.stage_index), kind, int(i)))
    return out


def simulate(
    orders: Sequence[Sequence[RankOp]],
    time_of: Callable[[RankOp], float],
    *,
    stages: int,
    send_s: Callable[[int], float] = lambda j: 0.0,
    start_s: Sequence[float] = (),
) -> List[float]:
    """When each rank finishes its ops: each runs its own in order, a forward after the previous
    stage's forward of the micro-batch, a backward (or input pass) after its own forward and the next
    stage's backward (the last stage's after its forward only), a weight pass after its input pass;
    a dependency across stages waits ``send_s(j)`` more (the send over boundary ``j`` -> ``j + 1``,
    zero where both stages share a rank).

    Args:
        orders: each rank's ops (:func:`rank_orders`).
        time_of: an op's seconds.
        stages: stages in the pipeline.
        send_s: seconds a message over boundary ``j`` takes.
        start_s: per rank, when it may start (FSDP's first gather); default 0.
    """
    plan = dependencies(tuple(tuple(o) for o in orders), stages)
    sends = [send_s(j) for j in range(stages - 1)]
    ranks = len(orders)
    end: Dict[Tuple[str, int, int], float] = {}
    clock = [start_s[r] if r < len(start_s) else 0.0 for r in range(ranks)]
    position = [0] * ranks
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for r in range(ranks):
            ops, steps = orders[r], plan[r]
            n = position[r]
            while n < len(ops):
                ready = ready_at(steps[n], end, sends, clock[r])
                if ready is None:
                    break
                clock[r] = ready + time_of(ops[n])
                end[steps[n][0]] = clock[r]
                n += 1
            if n != position[r]:
                left -= n - position[r]
                position[r] = n
                progressed = True
        if not progressed:
            raise RuntimeError(f"op orders deadlock: {[list(o) for o in orders]}")
    return clock


_Key = Tuple[str, int, int]
_Step = Tuple[_Key, Tuple[Tuple[_Key, int], ...]]


def ready_at(step: _Step, end: Dict[_Key, float], sends: Sequence[float], free: float) -> Optional[float]:
    """When an op (``step``, one of :func:`dependencies`' entries) may start on a rank free from
    ``free``: after each op it waits for has ended (``end``) and, across ranks, its message has
    arrived (``sends``, by boundary); None while one of them has not ended."""
    ready = free
    for key, boundary in step[1]:
        done = end.get(key)
        if done is None:
            return None
        ready = max(ready, done + (sends[boundary] if boundary >= 0 else 0.0))
    return ready


@functools.lru_cache(maxsize=512)
def dependencies(orders: Tuple[Tuple[RankOp, ...], ...], stages: int) -> Tuple[Tuple[_Step, ...], ...]:
    """Per rank and op: the key its end is kept under, and what it waits for, each with the boundary
    whose send it waits for too (-1: none, the dependency on the same rank)."""
    owner = {j: r for r, ops in enumerate(orders) for j, _, _ in ops}
    out = []
    for rank, ops in enumerate(orders):
        steps = []
        for j, kind, i in ops:
            deps: List[Tuple[_Key, int]] = []
            if kind == "F":
                if j > 0:
                    deps.append((("F", j - 1, i), j - 1 if owner.get(j - 1) != rank else -1))
            elif kind in ("B", "I"):
                deps.append((("F", j, i), -1))
                if j < stages - 1:
                    deps.append((("B", j + 1, i), j if owner.get(j + 1) != rank else -1))
            else:  # "W": after the input pass of the same micro-batch
                deps.append((("B", j, i), -1))
            steps.append((("B" if kind == "I" else kind, j, i), tuple(deps)))
        out.append(tuple(steps))
    return tuple(out)
