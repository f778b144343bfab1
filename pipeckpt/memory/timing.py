"""Each layer's forward and backward seconds, as the profile records them.

Measured per layer with backward pre-hooks as marks, on a clock a shared machine does not
inflate; on fake tensors, from FLOP counts instead (no kernel runs). Selective checkpointing's
own cost per layer is measured apart: on a dispatch-bound layer its hooks cost more than the
recompute it saves, which no FLOP count shows. Where that was not measured (a pytree between
layers, as a ``pipeline_of`` model passes; fake tensors), each op the layer runs is charged SAC's
host cost per op, measured once per process (:func:`sac_host_s_per_op`). Under the ``compile``
setting a selective layer's policy runs in its graph (pipeckpt/checkpointing/compiling.py): no
host cost, only the recompute of the ops the policy does not keep (:func:`for_compile`).
"""

import contextlib
import dataclasses
import functools
import statistics
import time
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple, TypeVar

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from pipeckpt._compat import DeferredBatchNorm, tree_flatten
from pipeckpt.checkpointing.selective import run_selective
from pipeckpt.stages.guards import side_effect_free


class _Timed(Protocol):
    """What :func:`selective_extra_s` reads of a layer's profile (``memory.profile.LayerProfile``,
    not imported: the profile imports this module)."""

    @property
    def forward_s(self) -> float: ...
    @property
    def sac_s(self) -> float: ...
    @property
    def sac_extra_s(self) -> Optional[float]: ...
    @property
    def ops(self) -> int: ...


class _Layered(Protocol):
    """What :func:`for_compile` reads of a model's profile (``memory.profile.ModelProfile``)."""

    @property
    def layers(self) -> Sequence[Any]: ...


_Profile = TypeVar("_Profile", bound=_Layered)

__all__ = ["clock", "for_compile", "sac_host_s_per_op", "selective_extra_s"]

_per_op: Optional[float] = None  # sac_host_s_per_op, once measured


def clock() -> Callable[[], float]:
    """The clock the timing passes read: on CPU with one torch thread, this process's CPU time,
    which a machine shared with other jobs does not inflate (the wall clock there counts every
    wait for a core); else the wall clock (a GPU's kernels, several threads' overlap)."""
    if torch.cuda.is_available() or torch.get_num_threads() > 1:
        return time.perf_counter
    return time.process_time


def _timing_pass(
    layers: List[nn.Module], x: Any, loss: Optional[nn.Module], rounds: int
) -> List[Tuple[float, float]]:
    """Median forward and backward seconds per layer over ``rounds`` (after one warm-up)."""
    modules = [*layers, *([loss] if loss is not None else [])]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    samples: List[List[Tuple[float, float]]] = [[] for _ in modules]
    tick = clock()
    for r in range(rounds + 1):
        marks: List[float] = []
        handles = [m.register_full_backward_pre_hook(_marker(marks, sync, tick)) for m in modules]
        forward_s = []
        try:
            h = x
            for m in modules:
                sync()
                t0 = tick()
                h = m(h)
                sync()
                forward_s.append(tick() - t0)
            outputs = [t for t in tree_flatten(h)[0] if isinstance(t, Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            sync()
            marks.append(tick())
        finally:
            for handle in handles:
                handle.remove()
        # The pre-hooks fire last layer first; a layer whose output needs no gradient has none.
        backward_s = [0.0] * len(modules)
        fired = [i for i in reversed(range(len(modules))) if _needs_grad(modules, i)]
        for k, i in enumerate(fired[: len(marks) - 1]):
            backward_s[i] = marks[k + 1] - marks[k]
        if r > 0:
            for i in range(len(modules)):
                samples[i].append((forward_s[i], backward_s[i]))
    return [
        (statistics.median(f for f, _ in s), statistics.median(b for _, b in s)) if s else (0.0, 0.0)
        for s in samples
    ]


def _selective_pass(layers: List[nn.Module], x: Any, rounds: int) -> List[Optional[float]]:
    """Per layer, the median seconds selective checkpointing adds to its forward + backward over
    ``rounds`` (after one warm-up): each layer alone on the input it gets, plain and under
    :func:`pipeckpt.checkpointing.selective.run_selective`, interleaved."""
    inputs, h = [], x
    with torch.no_grad():
        for m in layers:
            inputs.append(h)
            h = m(h)
    out: List[Optional[float]] = []
    for m, h in zip(layers, inputs):
        # A pytree between layers is left to the recompute estimate.
        out.append(_selective_extra(m, h, rounds) if isinstance(h, Tensor) else None)
    return out


def _selective_extra(layer: nn.Module, x: Tensor, rounds: int) -> Optional[float]:
    if any(isinstance(m, DeferredBatchNorm) for m in layer.modules()):
        # Its forward commits statistics that its recompute skips, which SAC's replay refuses: the
        # time is left to the recompute estimate (``sac_extra_s`` None).
        return None
    h = x.detach().requires_grad_(x.is_floating_point())
    tick = clock()
    # The stage's own guard: a recompute leaves BatchNorm statistics as the forward left them.
    guard = functools.partial(side_effect_free, layer)
    runs = (lambda: layer(h), lambda: run_selective(layer, (h,), {}, recompute_guard=guard))
    return _median_extra(runs, rounds, tick)


def _median_extra(
    runs: Tuple[Callable[[], Any], Callable[[], Any]], rounds: int, clock: Callable[[], float]
) -> float:
    """The median of what a forward + backward of ``runs[1]`` takes over one of ``runs[0]``, the two
    interleaved over ``rounds`` rounds after a warm-up round; never below 0."""
    extra = []
    for r in range(rounds + 1):
        took = []
        for run in runs:
            t0 = clock()
            _forward_backward_of(run)
            took.append(clock() - t0)
        if r > 0:
            extra.append(took[1] - took[0])
    return max(0.0, statistics.median(extra))


def _forward_backward_of(run: Callable[[], Any]) -> None:
    outputs = [t for t in tree_flatten(run())[0] if isinstance(t, Tensor) and t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def _marker(marks: List[float], sync: Callable[[], Any], clock: Callable[[], float]) -> Callable[..., None]:
    def mark(*_: Any) -> None:
        sync()
        marks.append(clock())

    return mark


def _needs_grad(modules: List[nn.Module], i: int) -> bool:
    """Whether module ``i``'s output takes part in backward: some module up to it has parameters."""
    return any(p.requires_grad for m in modules[: i + 1] for p in m.parameters())


def _flop_pass(
    layers: List[nn.Module], x: Any, loss: Optional[nn.Module], flops_per_s: float
) -> List[Tuple[float, float]]:
    """Forward and backward seconds per layer from FLOP counts (fake tensors run no kernels)."""
    modules = [*layers, *([loss] if loss is not None else [])]
    forward: List[float] = []
    h = x
    for m in modules:
        with FlopCounterMode(display=False) as counter:
            h = m(h)
        forward.append(counter.get_total_flops() / flops_per_s)
    # Backward of a matmul-dominated layer costs two forwards (input and weight gradients).
    return [(f, 2 * f) for f in forward]


def sac_host_s_per_op(rounds: int = 5, ops: int = 200) -> float:
    """Seconds eager SAC adds per op to a forward + backward (its dispatch mode's Python call in the
    forward and again in the recompute, and the policy), measured once per process: a chain of
    ``ops`` one-element additions, plain and under
    :func:`~pipeckpt.checkpointing.selective.run_selective`, interleaved, the median difference."""
    global _per_op
    if _per_op is None:
        x = torch.ones(1, requires_grad=True)

        def chain(h: Tensor) -> Tensor:
            for _ in range(ops):
                h = h + 1
            return h

        nothing = contextlib.nullcontext
        runs = (lambda: chain(x), lambda: run_selective(chain, (x,), {}, recompute_guard=nothing))
        _per_op = _median_extra(runs, rounds, clock()) / ops
    return _per_op


def selective_extra_s(layer: _Timed) -> float:
    """Seconds selective checkpointing adds to one recomputed micro-batch of ``layer``: as measured
    (``sac_extra_s``), else the recompute of the ops SAC does not keep plus SAC's host cost for
    each op the layer runs."""
    if layer.sac_extra_s is not None:
        return layer.sac_extra_s
    return max(0.0, layer.forward_s - layer.sac_s) + layer.ops * sac_host_s_per_op()


def for_compile(profile: _Profile, compiled: bool) -> _Profile:
    """``profile`` as the planner sees it under the ``compile`` setting (``compiled``): selective
    adds only the recompute of the ops SAC does not keep, the policy having run at compile time."""
    if not compiled:
        return profile
    layers = profile.layers
    recomputes = [max(0.0, x.forward_s - x.sac_s) for x in layers]
    out = tuple(dataclasses.replace(x, sac_extra_s=s) for x, s in zip(layers, recomputes))
    return dataclasses.replace(profile, layers=out)  # type: ignore[type-var]
