"""Who failed, and how, when a pipeline rank stops: by facts in the rendezvous store, not by error text.

Why not the transport's error: the neighbours of a failed process see only "Connection closed by
peer" or a timeout. So each rank publishes where it runs (node, PID, start time) and beats a counter
from a daemon thread, and a rank whose own code raised publishes its error first;
:meth:`Liveness.diagnose` then names a raising, lost or hung rank within its deadline. Counters rather
than timestamps, so that the clocks of different nodes never meet (docs/DESIGN.md,
engines/distributed/liveness).
"""

import atexit
import json
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

__all__: List[str] = []

_PREFIX = "pipeckpt/liveness/"


@dataclass
class Diagnosis:
    """What the other ranks were found doing after this rank's communication failed."""

    errors: Dict[int, Dict[str, str]] = field(default_factory=dict)
    """Ranks whose own code raised: their error's type, message and traceback."""
    lost: Optional[List[int]] = field(default_factory=list)
    """Ranks gone without a word; None when the store itself is unreachable."""
    elapsed_s: float = 0.0


class Liveness:
    def __init__(self, store: dist.Store, *, rank: int, world_size: int, period: float = 0.5) -> None:
        self._store = dist.PrefixStore(_PREFIX, store)
        self.rank = rank
        self.world_size = world_size
        self.period = period
        self.silence_s = 6 * period
        """How long a rank that no kernel here can see must stay silent to count as lost."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._store.delete_key(f"left/{self.rank}")
        self._store.delete_key(f"error/{self.rank}")
        self._store.set(f"process/{self.rank}", json.dumps(this_process()))
        self._store.add(f"beat/{self.rank}", 1)
        self._thread = threading.Thread(target=self._beat, name="pipeckpt-liveness", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # a process that exits without a teardown stops the beat too

    def stop(self) -> None:
        """Ends the beat, and returns only once its thread has left the store. Why wait: a daemon
        thread still inside a store call when the interpreter finalises aborts the whole process
        ("terminate called without an active exception": torch's binding takes the GIL back in a
        destructor that may not unwind), and a teardown under load can outlast any short wait.
        The wait is bounded all the same: a store call returns or raises within the store's timeout."""
        self._stop.set()
        atexit.unregister(self.stop)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._store.add(f"beat/{self.rank}", 1)
            except Exception:  # the store's host is gone; the main thread will find out
                return

    def report(self, error: BaseException, *, own: Optional[bool] = None) -> None:
        """Tells the others that this rank stops, and why if the error is its own (``own``; default:
        its user code raised it)."""
        try:
            if raised_here(error) if own is None else own:
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
        for r in self._others():
            if self._store.check([f"error/{r}"]):
                found[r] = json.loads(self._store.get(f"error/{r}").decode())
        return found

    def diagnose(self, *, within: float) -> Diagnosis:
        """Accounts for every other rank: raised (quoted), left (said so), alive (its process
        exists, or its counter moved) or lost (its process is gone, or it stayed silent for
        ``within`` seconds). Returns once each is known, at the latest after ``within``."""
        begun = time.monotonic()
        deadline = begun + within
        # Polled, not a blocking store.wait: a counter that moves has no key to wait for, and a
        # store client serialises its operations, so one blocked wait would stall the beat too.
        poll = self.period / 5
        try:
            first = {r: self._store.add(f"beat/{r}", 0) for r in self._others()}
            where = {r: self._process(r) for r in self._others()}
            pending, lost = set(first), []
            while True:
                errors = self.errors()
                if errors:
                    return Diagnosis(errors=errors, elapsed_s=time.monotonic() - begun)
                for r in sorted(pending):
                    exists = process_exists(where[r])
                    if exists is False and not self._store.check([f"left/{r}"]):
                        lost.append(r)
                    elif not (exists or self._store.check([f"left/{r}"])):
                        if self._store.add(f"beat/{r}", 0) == first[r]:
                            continue  # no fact about r yet
                    pending.discard(r)
                now = time.monotonic()
                if not pending or now >= deadline:
                    break
                time.sleep(min(poll, deadline - now))
            errors = self.errors()  # a report may have come in meanwhile
        except Exception:  # the store's host is gone
            return Diagnosis(lost=None, elapsed_s=time.monotonic() - begun)
        if errors:
            return Diagnosis(errors=errors, elapsed_s=time.monotonic() - begun)
        return Diagnosis(lost=sorted(lost + list(pending)), elapsed_s=time.monotonic() - begun)

    def explain(
        self, error: BaseException, *, me: int, describe: Callable[[int], str], timeout: float
    ) -> Optional[str]:
        """Reports ``error`` to the others and says which rank raised or was lost; None when this
        rank's own code raised it, whatever the phase, or it is an exit (it propagates as raised,
        and the others quote it)."""
        own = own_error(error)
        self.report(error, own=own)
        if own or isinstance(error, (SystemExit, KeyboardInterrupt)):
            return None
        found = self.diagnose(within=min(timeout, self.silence_s))
        if found.errors:
            return error_message(me=me, errors=found.errors, describe=describe)
        return lost_message(me=me, lost=found.lost, describe=describe, timeout=timeout)

    def _others(self) -> List[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _process(self, rank: int) -> Optional[Dict[str, object]]:
        if not self._store.check([f"process/{rank}"]):
            return None  # it died before it published where it runs
        return json.loads(self._store.get(f"process/{rank}").decode())


# -- a process, as the kernel of the node knows it ----------------------------------------------
# Hand-written on /proc: psutil would add a dependency for two fields of one file, and Linux is
# where this engine's jobs run; elsewhere process_exists() knows nothing and the beats decide.


_PF_EXITING = 0x4  # linux/sched.h: set as a process starts to exit, before its sockets close


def _node() -> Optional[str]:
    """This node and PID namespace: PIDs compare only between processes that share both."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{socket.gethostname()}/{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _stat(pid: int) -> Optional[List[str]]:
    """The fields of /proc/<pid>/stat after the command name (state first); None: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def this_process() -> Dict[str, object]:
    pid = os.getpid()
    stat = _stat(pid)
    return {"node": _node(), "pid": pid, "start": stat[19] if stat else None}


def process_exists(where: Optional[Dict[str, object]]) -> Optional[bool]:
    """Whether the process ``where`` describes still runs; None when this node cannot tell
    (another node or PID namespace, no /proc, or nothing published)."""
    if where is None or where["node"] is None or where["node"] != _node():
        return None
    stat = _stat(int(str(where["pid"])))
    if stat is None or stat[0] in ("Z", "X", "x") or int(stat[6]) & _PF_EXITING:
        return False  # gone, a zombie that its parent has not reaped yet, or on its way out
    return stat[19] == where["start"]  # another start time: the PID was reused


_MARK = "_pipeckpt_raised_here"


class _UserCode:
    """The context of :func:`user_code`: a class, not ``@contextmanager``, since every micro-batch
    enters it several times and a generator-based context costs five Python calls a use."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Optional[BaseException], trace: Any) -> None:
        if error is not None:  # the error goes on, marked
            mark_own(error)


_USER_CODE = _UserCode()


def mark_own(error: BaseException) -> None:
    """Marks ``error`` as this rank's own, as leaving :func:`user_code` does: for the paths that
    run for every micro-batch, as ``try: ... except BaseException as e: mark_own(e); raise``, which
    costs nothing until something raises (a ``with`` costs three Python calls a use)."""
    if not hasattr(error, _MARK):
        setattr(error, _MARK, True)


def user_code() -> _UserCode:
    """Within: an exception is the user's own (their step or layers), not a peer's failure."""
    return _USER_CODE


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


_COMMUNICATION = os.path.dirname(os.path.abspath(dist.__file__))  # torch/distributed


def _raised_in_communication(error: BaseException) -> bool:
    """Whether ``error``'s innermost frame is in torch.distributed (a collective, a point-to-point
    operation, the store): the only place where another rank's failure surfaces."""
    tb, last = error.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(_COMMUNICATION)


def own_error(error: BaseException) -> bool:
    """Whether ``error`` is this rank's own, whatever the phase (set-up, a checkpoint load, a step):
    its user code raised it, or nothing in its chain was raised inside communication. An exit
    (``SystemExit``, ``KeyboardInterrupt``) is no error of the rank's to quote."""
    if raised_here(error):
        return True
    if isinstance(error, (SystemExit, KeyboardInterrupt)):
        return False
    seen: Optional[BaseException] = error
    while seen is not None:
        if _raised_in_communication(seen):
            return False
        seen = seen.__cause__ or seen.__context__
    return True


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
