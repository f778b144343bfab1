"""Naming the lost rank when a collective fails.

When one process of a pipeline dies (killed, out of memory, a crashed node),
its neighbours see only a transport error such as gloo's "Connection closed by
peer [10.0.0.3]:41234", or a timeout, and ranks further down the pipeline fail
because their neighbour exited. Every rank therefore beats a counter in the
rendezvous store from a daemon thread, and a rank that stops with an error of
its own says so in the store first. After a failure, a survivor watches the
counters for a few periods: a rank whose counter stands still and that left
no word is the one that was lost.

Counters rather than timestamps, so that clocks of different nodes never meet.
Ranks that Lightning's launcher started on this node are known at once: their
process has exited.
"""

import os
import threading
import time
from typing import Callable, List, Optional

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

    def leaving(self) -> None:
        """Tells the others that this rank stops because of an error it saw."""
        try:
            self._store.set(f"left/{self.rank}", "1")
        except Exception:
            pass

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


def is_communication_failure(exception: BaseException) -> bool:
    """Whether ``exception`` (or what caused it) is a failed or timed-out collective."""
    seen: Optional[BaseException] = exception
    while seen is not None:
        if isinstance(seen, dist.DistError):
            return True
        text = str(seen)
        if any(s in text for s in _TRANSPORT_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_TRANSPORT_WORDS = (
    "Connection closed",
    "Connection reset",
    "Connection refused",
    "Broken pipe",
    "timed out",
    "Timed out",
    "Timeout",
    "gloo",
    "NCCL",
    "Socket",
    "socket",
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
