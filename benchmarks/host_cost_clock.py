"""The host-cost benchmark's timers (``benchmarks/bench_host_cost.py``): ``Clock``, the CPU, wall time
and (``--calls``) Python calls of each step of one run, and ``Parts``, the main thread's CPU in each
of a few methods of the schedule, the stage and the strategy (``--parts``).

Apart from the script because they are the measuring instrument, not what is measured: every method
of ``host_cost_methods`` runs under a ``Clock``, and ``Parts`` patches the classes all of them share.
"""

import cProfile
import pstats
import resource
import time
from typing import Any, Callable, Dict, List, Optional

from lightning.pytorch.strategies import Strategy
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from pipeckpt import PipelineStrategy


class Clock:
    """CPU and wall time at the start of every step, and the CPU spent inside the schedule's part."""

    parts: Optional["Parts"] = None  # ``--parts``: times its methods in every clock's timed steps
    last: Optional["Clock"] = None  # the clock made last

    def __init__(self, spec: Dict[str, Any]) -> None:
        Clock.last = self
        self.warmup, self.steps = spec["warmup"], spec["timed"]  # the window of timed steps
        self.profiler = cProfile.Profile() if spec.get("calls") else None
        self.calls = 0  # function calls made in the timed steps (``--calls``)
        self.cpu: List[float] = []
        self.main: List[float] = []  # the main thread's CPU (the process's less gloo's threads)
        self.sys: List[float] = []  # the process's CPU in the kernel
        self.wall: List[float] = []
        self.inner = 0.0

    def tick(self) -> None:
        if Clock.parts is not None:
            Clock.parts.turn(self)
        self.cpu.append(time.process_time())
        self.main.append(time.thread_time())
        self.sys.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime)
        self.wall.append(time.perf_counter())
        if self.profiler is not None:  # count the calls of the timed steps (the main thread's)
            if len(self.cpu) == self.warmup + 1:
                self.profiler.enable()
            elif len(self.cpu) == self.warmup + self.steps + 1:
                self.profiler.disable()
                self.calls = sum(row[1] for row in pstats.Stats(self.profiler).stats.values())  # type: ignore[attr-defined]

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, its CPU time added to ``inner`` during the timed steps."""

        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.warmup < len(self.cpu) <= self.warmup + self.steps:
                return fn(*args, **kwargs)
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inner += time.process_time() - start

        return run

    def per_step(self) -> Dict[str, float]:
        warmup, timed = self.warmup, self.steps
        return {
            "cpu": (self.cpu[warmup + timed] - self.cpu[warmup]) / timed,
            "main": (self.main[warmup + timed] - self.main[warmup]) / timed,
            "sys": (self.sys[warmup + timed] - self.sys[warmup]) / timed,
            "wall": (self.wall[warmup + timed] - self.wall[warmup]) / timed,
            "inner": self.inner / timed,
            "calls": self.calls / timed,
        }


class Parts:
    """Main-thread CPU per step in each of the methods named in bench_host_cost.py's docstring (``--parts``),
    over the timed steps of the run whose ``Clock`` it watches; a method re-entered from within
    itself (an override calling its parent) counts once."""

    METHODS = (
        ("schedule", Schedule1F1B, "step"),
        ("forward chunks", PipelineStage, "forward_one_chunk"),
        ("backward chunks", PipelineStage, "backward_one_chunk"),
        ("training_step", Strategy, "training_step"),
        ("training_step", PipelineStrategy, "training_step"),
        ("backward", Strategy, "backward"),
        ("backward", PipelineStrategy, "backward"),
        ("optimizer_step", Strategy, "optimizer_step"),
    )

    def __init__(self) -> None:
        self.on = False
        self.cpu: Dict[str, float] = {}
        self._inside: Dict[str, int] = {}
        for key, owner, name in self.METHODS:
            setattr(owner, name, self._timed(key, getattr(owner, name)))

    def _timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.on or self._inside.get(key):
                return fn(*args, **kwargs)
            self._inside[key] = 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[key] = self.cpu.get(key, 0.0) + time.thread_time() - start
                self._inside[key] = 0

        return run

    def turn(self, clock: Clock) -> None:
        """At a tick of ``clock`` (before it is counted): on at its first timed step, off after its last."""
        ticks = len(clock.cpu) + 1
        if ticks == clock.warmup + 1:
            self.cpu, self.on = {}, True
        elif ticks == clock.warmup + clock.steps + 1:
            self.on = False

    def per_step(self, clock: Clock) -> Dict[str, float]:
        c = {key: self.cpu.get(key, 0.0) / clock.steps for key, _, _ in self.METHODS}
        step = clock.per_step()["main"]
        return {
            "the schedule: forward chunks": c["forward chunks"],
            "the schedule: backward chunks": c["backward chunks"],
            "the schedule: the rest (losses, messages, its own logic)": c["schedule"]
            - c["forward chunks"]
            - c["backward chunks"],
            "training_step outside the schedule": c["training_step"] - c["schedule"],
            "the backward hook": c["backward"],
            "the optimizer and zeroing": c["optimizer_step"] - c["training_step"] - c["backward"],
            "the loop outside optimizer_step": step - c["optimizer_step"],
            "whole step (main thread)": step,
        }
