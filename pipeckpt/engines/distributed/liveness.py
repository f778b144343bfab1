"""Who failed, and how, when a pipeline rank stops: by structure, not by the words of an error.

When one process of a pipeline fails, its neighbours see only a transport
error ("Connection closed by peer") or a timeout, and ranks further down fail
because their neighbour exited. Three facts, each kept in the rendezvous store,
tell the survivors what happened:

- a rank whose own code raised (the user's step or layers: :func:`user_code`
  marks such exceptions where they are raised) publishes its error's type,
  message and traceback before it unwinds (:meth:`Liveness.report`), and every
  survivor quotes it, naming the rank;
- every rank beats a counter from a daemon thread; a rank whose counter stands
  still and that left no word was lost (killed, out of memory, a node gone);
- otherwise every rank is alive and one is stuck: the survivors' collectives
  ran out of the ``timeout`` they were given.

Counters rather than timestamps, so that clocks of different nodes never meet.
Ranks that Lightning's launcher started on this node are known at once: their
process has exited.
"""

import json
import os
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional

import torch.distributed as dist

__all__: List[str] = []

_PREFIX = "pipeckpt/liveness/"


class Liveness:
    def __init__(self, store: dist.Store, *, rank: int, world_size: int, period: float = 0.5) -> None:
        self._store = dist.PrefixStore(_PREFIX, store)
        self.rank = rank
        self.world_size = world_size
        self.period = period
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._store.delete_key(f"left/{self.rank}")
        self._store.add(f"beat/{self.rank}", 1)
        self._thread = threading.Thread(target=self._beat, name="pipeckpt-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period)
            self._thread = None

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._store.add(f"beat/{self.rank}", 1)
            except Exception:  # the store's host is gone; the main thread will find out
                return

    def report(self, error: BaseException) -> None:
        """Tells the others that this rank stops, and why if its own code raised."""
        try:
            if raised_here(error):
                origin = _origin(error)
                what = {
                    "type": type(origin).__name__,
                    "message": str(origin),
                    "traceback": "".join(traceback.format_exception(origin)).rstrip(),
                }
                self._store.set(f"error/{self.rank}", json.dumps(what))
            self._store.set(f"left/{self.rank}", "1")
        except Exception:  # the store's host is gone; nothing more can be said
            pass

    def errors(self) -> Dict[int, Dict[str, str]]:
        """The errors other ranks' own code raised, by rank."""
        found = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                if self._store.check([f"error/{r}"]):
                    found[r] = json.loads(self._store.get(f"error/{r}").decode())
            except Exception:
                return found
        return found

    def lost_ranks(self, watch_periods: int = 5) -> Optional[List[int]]:
        """Ranks that stopped beating without leaving word; None when the store
        itself is unreachable (its host, rank 0 unless torchrun hosts it, is gone)."""
        try:
            before = [self._store.add(f"beat/{r}", 0) for r in range(self.world_size)]
            time.sleep(watch_periods * self.period)
            after = [self._store.add(f"beat/{r}", 0) for r in range(self.world_size)]
            left = [self._store.check([f"left/{r}"]) for r in range(self.world_size)]
        except Exception:
            return None
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r] and not left[r]]


_MARK = "_pipeckpt_raised_here"


@contextmanager
def user_code() -> Iterator[None]:
    """Within: an exception is the user's own (their step or layers), not a peer's failure."""
    try:
        yield
    except BaseException as error:
        if not hasattr(error, _MARK):
            setattr(error, _MARK, True)
        raise


def _origin(error: BaseException) -> BaseException:
    """The first error of an explicit chain (torch re-raises a stage's error as its cause)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def raised_here(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) was raised by this rank's own code."""
    seen: Optional[BaseException] = error
    while seen is not None:
        if getattr(seen, _MARK, False):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def error_message(*, me: int, errors: Dict[int, Dict[str, str]], describe: Callable[[int], str]) -> str:
    """What a survivor says when another rank's own code raised."""
    rank = min(errors)
    what = errors[rank]
    return (
        f"pipeckpt: {describe(rank)} raised {what['type']}: {what['message']}\n"
        f"so rank {me} could not go on. {describe(rank)}'s traceback:\n{what['traceback']}"
    )


def lost_message(
    *, me: int, lost: Optional[List[int]], describe: Callable[[int], str], timeout: float
) -> str:
    """What a survivor says, given the ranks found lost (None: the store is unreachable)."""
    if lost is None:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (
            f"pipeckpt: lost rank 0 or the rendezvous store at {where} (rank 0 hosts it unless "
            f"torchrun's agent does): rank {me} cannot reach it after its communication failed. "
            "HINT: look for the cause in rank 0's output and the job's exit codes"
        )
    if lost:
        names = "; ".join(describe(r) for r in lost)
        return (
            f"pipeckpt: lost {names}: it stopped without reporting an error (killed, out of "
            f"memory, or its node failed), so rank {me} could not go on. HINT: look for the "
            f"cause in the output of rank {lost[0]} and the job's exit codes"
        )
    return (
        f"pipeckpt: rank {me} failed in a collective while every other rank is alive: one is "
        f"stuck or slower than timeout={timeout:g}s. HINT: raise the strategy's `timeout`, or "
        "look for a rank that hangs"
    )
