"""The layout search: drop what cannot fit, fit the rest, rank what fits by predicted step time.

Why three passes of rising cost: most layouts of a large model on a large world fail on their
parameters' share alone, which shapes answer in microseconds; the survivors need a profile and a
memory walk (:mod:`pipeckpt.layout.fit`, the memory function), and only a layout that fits is worth a
cost estimate. Asked for the ``top`` fastest only, it also skips the fit of every layout that a step
floor (:mod:`pipeckpt.layout.floor`) shows slower than them. The memory and cost functions are
arguments, so the search is the same code whether they come from a profile on this machine, from
FLOP counts against a published device, or from a test that states them.
"""

import heapq
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Protocol, Sequence, Set, Tuple

from pipeckpt._errors import PipeckptConfigError, config_error
from pipeckpt.layout.candidates import Candidate
from pipeckpt.layout.fit import Fitted
from pipeckpt.sizes import human

__all__ = ["Estimate", "Ranked", "Dropped", "Searched", "search", "why_lost", "PARTS"]


class Estimate(Protocol):
    """What the search reads of a cost estimate (:class:`pipeckpt.layout.cost.StepEstimate`'s fields)."""

    @property
    def step_s(self) -> float: ...
    @property
    def compute_s(self) -> float: ...
    @property
    def recompute_s(self) -> float: ...
    @property
    def bubble_s(self) -> float: ...
    @property
    def comm_s(self) -> float: ...
    @property
    def exposed_comm_s(self) -> float: ...
    @property
    def engine_s(self) -> float: ...
    @property
    def tokens_per_s_per_device(self) -> float: ...
    @property
    def mfu(self) -> float: ...


#: The parts of a step a runner-up can lose by, as an estimate names them, and as a sentence says them.
PARTS: Tuple[Tuple[str, str], ...] = (
    ("compute_s", "compute"),
    ("recompute_s", "recompute"),
    ("bubble_s", "pipeline bubble"),
    ("exposed_comm_s", "exposed communication"),
    ("engine_s", "engine cost per micro-batch"),
    ("optimizer_s", "optimizer step"),
)


@dataclass(frozen=True)
class Ranked:
    """A layout that fits, its modes chosen, with its predicted step."""

    fitted: Fitted
    estimate: Estimate

    @property
    def candidate(self) -> Candidate:
        return self.fitted.candidate

    @property
    def bubble_share(self) -> float:
        return self.estimate.bubble_s / self.estimate.step_s if self.estimate.step_s else 0.0

    @property
    def comm_share(self) -> float:
        return self.estimate.exposed_comm_s / self.estimate.step_s if self.estimate.step_s else 0.0


#: Why a layout reducing every micro-batch is dropped when its twin fits with nothing recomputed.
DOMINATED = "slower than the same layout reducing once a step, which fits without recompute"


@dataclass(frozen=True)
class Dropped:
    """A layout the search dropped, and why in one line."""

    candidate: Candidate
    # "state": its parameters, gradients and optimizer state alone; "memory": no modes fit;
    # "dominated": a twin as fast or faster in the same memory (DOMINATED); "floor": slower than the
    # ``top`` fastest whatever its modes, not fitted (search's floor)
    stage: str
    reason: str


@dataclass(frozen=True)
class Searched:
    """The search's answer: the layouts that fit, fastest first, and those dropped."""

    ranked: Tuple[Ranked, ...]
    dropped: Tuple[Dropped, ...]
    considered: int

    @property
    def best(self) -> Ranked:
        if not self.ranked:
            raise self.nothing_fits()
        return self.ranked[0]

    def dropped_at(self, stage: str) -> int:
        return sum(1 for d in self.dropped if d.stage == stage)

    def nothing_fits(self) -> PipeckptConfigError:
        """The error to raise when no layout fits: the counts, and the closest miss's reason."""
        closest = next((d for d in self.dropped if d.stage == "memory"), None) or next(
            iter(self.dropped), None
        )
        return config_error(
            f"strategy.layout=auto over {self.considered} layouts",
            f"none fits the device: {self.dropped_at('state')} on their parameters, gradients and "
            f"optimizer state alone, {self.dropped_at('memory')} with every checkpoint mode"
            + (
                f" (e.g. {closest.candidate.describe()} {closest.candidate.schedule}: {closest.reason})"
                if closest
                else ""
            ),
            "use more devices, a device with more memory (cluster=...), a smaller global batch "
            "(data.batch_size) or a smaller model",
        )


def search(
    candidates: Sequence[Candidate],
    *,
    device_bytes: int,
    state: Callable[[Candidate], int],
    memory: Callable[[Candidate], Fitted],
    cost: Callable[[Candidate], Estimate],
    top: Optional[int] = None,
    progress: Optional[Callable[[int, int, int], None]] = None,
    floor: Optional[Callable[[Candidate], float]] = None,
) -> Searched:
    """Every candidate that fits ``device_bytes`` on each of its ranks, fastest first.

    Args:
        candidates: the layouts to consider (:func:`pipeckpt.layout.candidates.candidates`).
        device_bytes: one device's memory.
        state: one rank's parameters, gradients and optimizer state under a layout (bytes): above
            ``device_bytes`` the layout is dropped before ``memory`` is asked.
        memory: the layout with its modes chosen and each rank's peak; raises
            :class:`~pipeckpt.PipeckptConfigError` where no modes fit.
        cost: the predicted step of a layout whose modes are chosen.
        top: keep only the fastest ``top`` (None: all).
        progress: told ``(layouts done, layouts, layouts that fit so far)`` before each layout (a
            search of a thousand-GPU world runs for an hour: its caller says how far it is).
        floor: with ``top``, a step no modes can beat for each layout
            (:func:`pipeckpt.layout.floor.step_floor`): the layouts are visited by their floor and
            the search stops at the first whose floor is above the ``top``-th fastest step found,
            the rest dropped unfitted ("floor"); before that, a layout whose ``cost`` with no modes
            (nothing recomputed) is above it is dropped unfitted too. It ranks the ``top`` layouts
            a search of every layout ranks first.
    """
    dropped: List[Dropped] = []
    ranked: List[Ranked] = []
    unbound: Set[Candidate] = set()  # layouts ranked with no stage recomputing, gradients reduced once
    order, floors, keep = list(candidates), {}, top or 0
    if floor is not None and keep:
        floors = {c: floor(c) for c in order}
        order.sort(key=floors.__getitem__)  # stable: a layout reducing every micro-batch after its twin
    fastest: List[float] = []  # the ``top`` fastest steps so far, a heap of their negatives
    for done, c in enumerate(order):
        if progress is not None:
            progress(done, len(order), len(ranked))
        if floors and len(fastest) == keep and floors[c] > -fastest[0]:
            above = f"above the {keep} fastest (to {human_s(-fastest[0])})"
            dropped.extend(
                Dropped(rest, "floor", f"no modes beat {human_s(floors[rest])}, {above}")
                for rest in order[done:]
            )
            break
        if c.reduce_every and replace(c, reduce_every=False) in unbound:
            # Reducing every micro-batch only adds reduce-scatters: it buys memory, which a layout
            # that fits without any recompute cannot spend (its twin, just ranked, is faster).
            dropped.append(Dropped(c, "dominated", DOMINATED))
            continue
        held = state(c)
        unchecked: Optional[Estimate] = None  # the step with nothing recomputed, once priced
        if floors and held <= device_bytes and len(fastest) == keep:
            # no modes the fit could choose make it faster
            unchecked = cost(c)
            if unchecked.step_s > -fastest[0]:
                reason = f"{human_s(unchecked.step_s)} with nothing recomputed, above the {keep} fastest"
                dropped.append(Dropped(c, "floor", reason))
                continue
        if held > device_bytes:
            dropped.append(
                Dropped(
                    c,
                    "state",
                    f"parameters, gradients and optimizer state {human(held)} > {human(device_bytes)}",
                )
            )
            continue
        try:
            fitted = memory(c)
        except PipeckptConfigError as error:
            dropped.append(Dropped(c, "memory", str(error).split("\n")[0]))
            continue
        if fitted.peak > device_bytes:  # a looped schedule's rank: its stages walked together
            dropped.append(Dropped(c, "memory", f"peak {human(fitted.peak)} > {human(device_bytes)}"))
            continue
        never = all(m == "never" for m in fitted.candidate.modes)
        ranked.append(
            Ranked(fitted, unchecked if never and unchecked is not None else cost(fitted.candidate))
        )
        if floors:
            heapq.heappush(fastest, -ranked[-1].estimate.step_s)
            if len(fastest) > keep:
                heapq.heappop(fastest)
        if not c.reduce_every and never:
            unbound.add(c)
    ranked.sort(key=_order)
    return Searched(tuple(ranked[:top] if top else ranked), tuple(dropped), len(candidates))


def human_s(seconds: float) -> str:
    """A step's seconds as a table reads them: ``1234.5 ms``."""
    return f"{seconds * 1e3:.1f} ms"


def _order(r: Ranked) -> Tuple[float, int, int, int, str, int]:
    """Fastest first; at equal time the lower peak, then fewer stages, less tensor parallelism and
    fewer micro-batches (simpler layouts), then the schedule's name: a total order, so a search
    repeated on the same numbers picks the same layout on every process."""
    c = r.candidate
    return (r.estimate.step_s, r.fitted.peak, c.stages * c.tp, c.chunks, c.schedule, c.dp_shard)


def why_lost(runner_up: Ranked, best: Ranked) -> str:
    """One line: by how much the runner-up is slower than the best, and the part of the step where
    it loses most (or that it ties and loses on memory)."""
    a, b = runner_up.estimate, best.estimate
    name = (
        f"{runner_up.candidate.describe()} {runner_up.candidate.schedule} chunks {runner_up.candidate.chunks}"
    )
    if a.step_s <= b.step_s:
        return f"runner-up {name}: as fast, ranked second on its peak ({human(runner_up.fitted.peak)})"
    worse = max(PARTS, key=lambda p: getattr(a, p[0], 0.0) - getattr(b, p[0], 0.0))
    more = getattr(a, worse[0], 0.0) - getattr(b, worse[0], 0.0)  # an estimate may not split it out
    return (
        f"runner-up {name}: {100 * (a.step_s / b.step_s - 1):.1f}% slower "
        f"({a.step_s * 1e3:.1f} vs {b.step_s * 1e3:.1f} ms), most of it {worse[1]} "
        f"(+{more * 1e3:.2f} ms)"
    )


def with_modes(c: Candidate, modes: Sequence[str]) -> Candidate:
    """``c`` with the checkpoint modes given (a layout given by hand, checked as the search checks)."""
    return replace(c, modes=tuple(modes))
