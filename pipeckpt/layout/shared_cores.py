"""A schedule's step when its processes share fewer cores than there are processes (a CPU machine).

Why a simulation of its own: :func:`pipeckpt.layout.orders.simulate` gives every rank a device of its
own. On this machine's ``cluster=local`` four single-threaded processes share two cores, and what a
pipeline loses there is neither its bubble nor its total work over the cores: while every stage of a
1F1B steady state is busy, each runs at half speed, so the chain of dependencies through the stages
is slowed too, and in the fill and drain an idle rank's core is lent to the busy ones only up to one
core a process. The old bound (every process's work over the cores, or the dedicated-device step,
whichever is longer) predicted a 4-stage pipeline 0.69-0.76 of its measured step while a 2-stage
pipeline of 2 replicas (never more than two processes busy) came out right; this one shares the
cores among the processes with work ready, moment by moment (processor sharing, as the kernel's fair
scheduler does between runnable processes of one thread).

The rules of the ops' order and dependencies are :func:`~pipeckpt.layout.orders.simulate`'s, shared
through :func:`~pipeckpt.layout.orders.dependencies` and :func:`~pipeckpt.layout.orders.ready_at`.
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from pipeckpt.layout.orders import RankOp, dependencies, ready_at

__all__ = ["simulate_shared"]

_EPS = 1e-12


def simulate_shared(
    orders: Sequence[Sequence[RankOp]],
    time_of: Callable[[RankOp], float],
    *,
    stages: int,
    cores: float,
    replicas: int = 1,
    send_s: Callable[[int], float] = lambda j: 0.0,
    start_s: Sequence[float] = (),
    tail_s: Sequence[float] = (),
) -> List[float]:
    """When each pipeline rank finishes its ops and then its ``tail_s`` (the optimizer step and the
    gradients' collectives), the world's processes sharing ``cores`` cores.

    Every op's seconds (``time_of``) are its work on a core of its own; a rank with an op ready runs
    it at ``min(1, cores / (replicas * ranks with an op ready))`` of that speed. A rank waiting for
    another stage or for a message uses no core; a message (``send_s``) and a rank's start
    (``start_s``, FSDP's first gather) are waits, not work.

    Args:
        orders: each pipeline rank's ops (:func:`pipeckpt.layout.orders.rank_orders`).
        time_of: an op's seconds on a core of its own.
        stages: stages in the pipeline.
        cores: the cores the world's processes share.
        replicas: processes per pipeline rank (tensor- and data-parallel ranks), all in step.
        send_s: seconds a message over boundary ``j`` -> ``j + 1`` takes.
        start_s: per rank, when it may start.
        tail_s: per rank, work after its last op.
    """
    plan = dependencies(tuple(tuple(o) for o in orders), stages)
    sends = [send_s(j) for j in range(stages - 1)]
    ranks = len(orders)
    tails = [tail_s[r] if r < len(tail_s) else 0.0 for r in range(ranks)]
    free_at = [start_s[r] if r < len(start_s) else 0.0 for r in range(ranks)]
    position = [0] * ranks  # the op running or next; len(orders[r]): the tail
    left: List[Optional[float]] = [None] * ranks  # the work left of what runs (None: waiting)
    finish: List[Optional[float]] = [None] * ranks
    end: Dict[Tuple[str, int, int], float] = {}
    now = 0.0
    while any(f is None for f in finish):
        waits = []
        for r in range(ranks):
            if finish[r] is not None or left[r] is not None:
                continue
            n = position[r]
            ready = free_at[r] if n == len(orders[r]) else ready_at(plan[r][n], end, sends, free_at[r])
            if ready is None:
                continue
            if ready > now + _EPS:
                waits.append(ready)
                continue
            left[r] = time_of(orders[r][n]) if n < len(orders[r]) else tails[r]
        running = [r for r in range(ranks) if left[r] is not None]
        if not running and not waits:
            raise RuntimeError(f"op orders deadlock: {[list(o) for o in orders]}")
        rate = min(1.0, cores / (replicas * len(running))) if running else 1.0
        step = min([left[r] / rate for r in running] + [w - now for w in waits])  # type: ignore[operator]
        now += step
        for r in running:
            left[r] -= step * rate  # type: ignore[operator]
            if left[r] > _EPS:  # type: ignore[operator]
                continue
            left[r] = None
            n = position[r]
            if n == len(orders[r]):
                finish[r] = now
                continue
            end[plan[r][n][0]] = now
            position[r] = n + 1
            free_at[r] = now
    return [f for f in finish if f is not None]
