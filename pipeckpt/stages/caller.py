"""The caller's thread-local state, carried to the threads that run its stages.

Autocast and dispatch modes (``FlopCounterMode``, ``MemTracker``) are thread-local: a stage run
on another thread than the caller's re-enters them (:class:`CallerState`); on the caller's own
thread there is nothing to apply, at no cost. Where the caller's autocast caches its weight casts
(``torch.autocast``'s default), the cache is held across one step's recomputes on a thread
(:class:`StepCasts`), which run in backward, outside the caller's autocast, so a weight is cast once
per step rather than once per recomputed micro-batch. Where it does not (Lightning's mixed precision
opens autocast without the cache), a recompute casts afresh, as each micro-batch's forward did, and
holds its casts no longer than its own backward: the memory a profile of one micro-batch counts.
"""

import contextlib
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import ContextManager, Iterator, Optional, Tuple

import torch

from pipeckpt._compat import TorchDispatchMode, dispatch_mode_stack, pop_dispatch_mode, push_dispatch_mode

__all__ = [
    "Autocast",
    "CallerState",
    "StepCasts",
    "autocast_now",
    "caches_casts",
    "entered",
    "capture_caller_state",
    "hold_cast_cache",
    "release_cast_cache",
]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
_NOTHING = contextlib.nullcontext()

# The autocast regions active on a thread: (device type, dtype, whether weight casts are cached) of each.
Autocast = Tuple[Tuple[str, torch.dtype, bool], ...]


def autocast_now() -> Autocast:
    """The autocast regions active on this thread."""
    cache = torch.is_autocast_cache_enabled()
    return tuple(
        (d, torch.get_autocast_dtype(d), cache)
        for d in _AUTOCAST_DEVICE_TYPES
        if torch.is_autocast_enabled(d)
    )


def caches_casts(autocast: Autocast) -> bool:
    """Whether these regions keep their weight casts until the outermost one exits."""
    return any(cache for _, _, cache in autocast)


def entered(autocast: Autocast, stack: ExitStack) -> None:
    """Enters ``autocast``'s regions on ``stack``, each as it was on the thread it was read on."""
    for device_type, dtype, cache in autocast:
        stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))


@dataclass(frozen=True)
class CallerState:
    """Thread-local state of the thread that called the pipeline.

    Args:
        autocast: the caller's autocast regions.
        dispatch_modes: the caller's dispatch-mode stack, innermost last.
        thread: ``threading.get_ident()`` of the caller; None: unknown.
    """

    autocast: Autocast = ()
    dispatch_modes: Tuple[TorchDispatchMode, ...] = ()
    thread: Optional[int] = None

    @property
    def active(self) -> bool:
        """Whether the caller had autocast or a dispatch mode active."""
        return bool(self.autocast or self.dispatch_modes)

    def needs_applying(self) -> bool:
        """False on the caller's own thread, or when the caller had nothing active."""
        return self.active and self.thread != threading.get_ident()

    def applied(self) -> ContextManager[None]:
        if not self.needs_applying():
            return _NOTHING
        return self._apply()

    @contextmanager
    def _apply(self) -> Iterator[None]:
        # Modes already on this thread's stack stay as they are.
        present = {id(m) for m in dispatch_mode_stack()}
        pushed = [m for m in self.dispatch_modes if id(m) not in present]
        for mode in pushed:
            push_dispatch_mode(mode)
        try:
            with ExitStack() as stack:
                entered(self.autocast, stack)
                yield
        finally:
            for _ in pushed:
                pop_dispatch_mode()


def capture_caller_state() -> CallerState:
    """This thread's autocast and dispatch modes, to apply on the threads that run its stages."""
    return CallerState(
        autocast=autocast_now(), dispatch_modes=tuple(dispatch_mode_stack()), thread=threading.get_ident()
    )


@dataclass
class StepCasts:
    """One step's recomputes, shared by the stages of one engine: how many are still
    to run, so the last one on a thread lets autocast's cast cache go.

    Args:
        remaining: the recomputes the step still runs.
    """

    remaining: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def one_done(self) -> bool:
        with self.lock:
            self.remaining -= 1
            return self.remaining <= 0


class _CastCacheHold(threading.local):
    """Autocast drops its weight-cast cache whenever the outermost autocast exits, and a
    recompute enters autocast afresh (backward runs outside the caller's autocast), so
    every recompute would cast the stage's weights again. While a step's recomputes run,
    this holds one extra autocast nesting level on their thread: the cast of a weight
    made by the first recompute serves the others. It is let go after the step's last
    recompute, or when another step starts (weights may have changed since)."""

    step: Optional[StepCasts] = None

    def hold(self, step: StepCasts) -> None:
        if self.step is step:
            return
        self.release()
        torch.autocast_increment_nesting()
        self.step = step

    def release(self) -> None:
        if self.step is None:
            return
        self.step = None
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


_cast_cache = _CastCacheHold()


def hold_cast_cache(step: StepCasts) -> None:
    """Keeps autocast's cast cache on this thread until ``step``'s last recompute."""
    _cast_cache.hold(step)


def release_cast_cache() -> None:
    """Lets go of a cast cache this thread still holds (a backward stopped midway, or a step's last
    recompute)."""
    _cast_cache.release()
