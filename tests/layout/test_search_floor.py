"""A search for the ``top`` fastest with a step floor: it visits the layouts by their floor, fits
none that cannot be among the fastest, and ranks the same ``top`` as a search of every layout.

The floor, the memory and the cost here are stated numbers (the search takes them as functions);
tests/layout/test_floor.py checks the real floor against the real cost model."""

from dataclasses import dataclass, replace
from typing import Dict, List, Optional

from pipeckpt.layout.candidates import Candidate
from pipeckpt.layout.fit import Fitted
from pipeckpt.layout.search import search
from pipeckpt.memory.predict import Prediction

NO_PREDICTION = Prediction(stages=(), step_time_s=0.0, schedule="gpipe", order_source="", chunks=1)


@dataclass(frozen=True)
class Step:
    step_s: float


def layout(chunks: int) -> Candidate:
    return Candidate(1, 1, 1, 1, "gpipe", 1, chunks)


# per layout (by its chunks): its step with nothing recomputed, and with the modes its fit chooses
UNCHECKED = {1: 5.0, 2: 2.2, 3: 4.0, 4: 1.0, 5: 2.0, 6: 9.0}
RECOMPUTING = {3: 6.0, 5: 2.5}  # these two need recompute to fit, which costs time
FLOOR = {1: 4.0, 2: 2.0, 3: 3.5, 4: 0.5, 5: 1.0, 6: 2.1}


def _search(top: int, fits: List[int], floor: bool = True, priced: Optional[List[int]] = None) -> List[int]:
    """The chunks of the layouts ranked; ``fits`` and ``priced`` gather those fitted and priced."""

    def memory(c: Candidate) -> Fitted:
        fits.append(c.chunks)
        modes = ("always",) if c.chunks in RECOMPUTING else ("never",)
        return Fitted(replace(c, modes=modes), (1,), (10,), NO_PREDICTION)

    def cost(c: Candidate) -> Step:
        if priced is not None:
            priced.append(c.chunks)
        return Step(RECOMPUTING[c.chunks] if c.modes == ("always",) else UNCHECKED[c.chunks])

    found = search(
        [layout(m) for m in UNCHECKED],
        device_bytes=100,
        state=lambda c: 0,
        memory=memory,
        cost=cost,
        top=top,
        floor=(lambda c: FLOOR[c.chunks]) if floor else None,
    )
    return [r.candidate.chunks for r in found.ranked]


def test_the_top_found_with_the_floor_are_those_of_every_layout() -> None:
    for top in range(1, len(UNCHECKED) + 1):
        assert _search(top, [], floor=True) == _search(top, [], floor=False), top


def test_layouts_are_fitted_by_their_floor_until_it_is_above_the_top() -> None:
    fits: List[int] = []
    assert _search(2, fits) == [4, 2]
    # floors 0.5 (chunks 4), 1.0 (5): the two fastest so far 1.0 and 2.5 (5 recomputes); chunks 2's
    # floor 2.0 is below 2.5: fitted, 2.2; chunks 6's floor 2.1 is below 2.2 too, but its step with
    # nothing recomputed is 9.0: not fitted; chunks 3's floor 3.5 is above 2.2: the search stops
    assert fits == [4, 5, 2]


def test_what_the_floor_drops_is_said_with_the_step_it_cannot_beat() -> None:
    def floors() -> Dict[str, int]:
        found = search(
            [layout(m) for m in UNCHECKED],
            device_bytes=100,
            state=lambda c: 0,
            memory=lambda c: Fitted(c, (1,), (10,), NO_PREDICTION),
            cost=lambda c: Step(UNCHECKED[c.chunks]),
            top=1,
            floor=lambda c: FLOOR[c.chunks],
        )
        assert [r.candidate.chunks for r in found.ranked] == [4]
        return {d.reason.split(",")[0]: d.candidate.chunks for d in found.dropped if d.stage == "floor"}

    said = floors()
    # chunks 5's floor (1.0) is not above the fastest (1.0), its step with nothing recomputed is
    assert said == {
        "2000.0 ms with nothing recomputed": 5,
        "no modes beat 2000.0 ms": 2,
        "no modes beat 2100.0 ms": 6,
        "no modes beat 3500.0 ms": 3,
        "no modes beat 4000.0 ms": 1,
    }


def test_a_layout_priced_with_nothing_recomputed_that_fits_so_is_not_priced_again() -> None:
    priced: List[int] = []
    assert _search(2, [], priced=priced) == [4, 2]
    # chunks 4 and 5 fill the two places, each priced once fitted; chunks 2 is priced with nothing
    # recomputed (2.2), fits so, and keeps that price; chunks 6 is priced so and dropped (9.0)
    assert priced == [4, 5, 2, 6]
