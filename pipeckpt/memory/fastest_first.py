"""The combinations of per-stage options in order of their summed time, fastest first.

Why: on one device the budget bounds every stage's memory together, so ``checkpoint='auto'`` scores
combinations of per-stage modes, and their count is the product of the stages' options (4 options
on 8 stages: 65,536). The fastest combination that fits is the answer, so walking them fastest first
stops at it, having predicted only the faster ones (which did not fit). Each index vector is reached
once, from the one whose highest moved stage is one option slower (a k-way merge of sorted lists).
"""

import heapq
from typing import Iterator, List, Sequence, Tuple

__all__ = ["fastest_first"]


def fastest_first(times: Sequence[Sequence[float]]) -> Iterator[Tuple[float, Tuple[int, ...]]]:
    """Every index vector into ``times`` (one list per stage, each sorted ascending), with its summed
    time, in order of that sum (ties in any order)."""
    if not times or any(not t for t in times):
        return
    start = (0,) * len(times)
    heap: List[Tuple[float, Tuple[int, ...], int]] = [(_total(times, start), start, 0)]
    while heap:
        total, index, lowest = heapq.heappop(heap)
        yield total, index
        for j in range(lowest, len(times)):  # move only stages at or past the last one moved
            if index[j] + 1 < len(times[j]):
                moved = (*index[:j], index[j] + 1, *index[j + 1 :])
                heapq.heappush(heap, (_total(times, moved), moved, j))


def _total(times: Sequence[Sequence[float]], index: Tuple[int, ...]) -> float:
    return sum(t[i] for t, i in zip(times, index))
