"""Stop requests (SIGTERM, SLURM's signal) of any rank, to the pipeline's last stage through the
process group's key-value store; the last stage decides, and its step outcome tells every rank.

Why not a collective: every rank would join it every step, for requests that come once a job. On
gloo a small all-reduce costs about 1 ms of CPU per rank, six times a broadcast; the store costs
the last stage one round trip per step (tens of microseconds) and the requesting rank two, once.
Why the last stage decides: the step's outcome already goes from it to every rank (a broadcast,
:mod:`.outcome`), so a flag in it reaches every rank at the same step: the ranks agree without a
collective of their own. A request posted while the last stage has already read the store for this
step is read at the next one, so the boundary may come one step later than with a collective.

The store holds, under a prefix the last stage draws once per :class:`StopRelay` (so that a later
fit of the same job never reads an earlier one's requests): a counter of posted requests, and one
key per posted request naming its callback. Those keys are never rewritten, so the counter tells the
last stage exactly which requests are new.
"""

from typing import List, Optional, Sequence

from pipeckpt._compat import default_store
from pipeckpt.state.preemption import PreemptionCallback

__all__: List[str] = []

_PREFIXES = "pipeckpt/stop-requests"  # the counter the prefixes are drawn from


class StopRelay:
    """The stop requests of ``stops`` (the same callbacks, in the same order, on every rank).

    Args:
        stops: the preemption callbacks of this rank.
        decides: whether this rank is the pipeline's last stage.
        src: the global rank of the last stage (in the prefix: pipelines never share a key).
    """

    def __init__(self, stops: Sequence[PreemptionCallback], *, decides: bool, src: int) -> None:
        self.stops = list(stops)
        self.decides = decides
        self._store = default_store() if self.stops else None
        self._generation: Optional[int] = None  # drawn by the last stage; the others learn it
        if self._store is not None and decides:
            self._generation = int(self._store.add(_PREFIXES, 1))
        self._src = src
        self._posted = [False] * len(self.stops)  # this rank's requests in the store (not deciding)
        self._read = 0  # requests the last stage has read

    def __len__(self) -> int:
        return len(self.stops)

    @property
    def generation(self) -> float:
        """The prefix's number, which the last stage sends with the outcome (0: none yet)."""
        return float(self._generation or 0)

    def learn(self, generation: float) -> None:
        """The prefix's number, from the last stage's outcome."""
        if self._generation is None and generation > 0:
            self._generation = int(generation)

    def post(self) -> None:
        """Puts this rank's new requests in the store (not on the last stage: it reads its own)."""
        if self.decides or self._store is None or self._generation is None:
            return
        for k, stop in enumerate(self.stops):
            if stop.requested and not self._posted[k]:
                n = int(self._store.add(self._counter, 1))
                self._store.set(f"{self._counter}/{n}", str(k))
                self._posted[k] = True
            elif not stop.requested:  # a new fit forgot it: a later request is posted again
                self._posted[k] = False

    def decide(self) -> List[float]:
        """On the last stage: each callback's request, of this rank or posted by any rank (1.0 or 0.0)."""
        agreed = [float(stop.requested) for stop in self.stops]
        if self._store is None:
            return agreed
        posted = int(self._store.add(self._counter, 0))
        for n in range(self._read + 1, posted + 1):
            # The poster counts before it names the callback: get waits for the name.
            agreed[int(self._store.get(f"{self._counter}/{n}"))] = 1.0
        self._read = max(self._read, posted)
        return agreed

    def tell(self, agreed: Sequence[float]) -> None:
        """Every rank: the last stage's decision, handed to the callbacks' step boundaries."""
        for stop, request in zip(self.stops, agreed):
            stop.carry(request > 0)

    @property
    def _counter(self) -> str:
        return f"{_PREFIXES}/{self._src}/{self._generation}"
