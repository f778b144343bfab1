"""A per-stage memory and time model of a pipelined training step, fitted from one profiled micro-batch.

Why a model and not a measurement: a user choosing checkpoint modes, chunks and a balance faces
4^S x chunks x balances combinations, and measuring each costs a training step on the real
devices. Memory in a pipeline follows a few rules that a profile of one micro-batch fixes:

- a stage holds, for every micro-batch in flight (forwarded, not yet backwarded), what its layers
  saved for backward, or only its input where the micro-batch is recomputed;
- which micro-batches are in flight at each moment is the schedule's op order: the local engine
  (torchgpipe) runs all forwards, then the backwards from the last micro-batch; torch's GPipe from
  the first; torch's 1F1B holds at most ``stages - i`` on stage ``i``;
- the backward of one micro-batch adds its recompute (the stage's saved tensors, rebuilt) and the
  working set of each layer's backward, measured once per layer;
- under torch's schedules a stage also holds receive buffers, each micro-batch's output until its
  backward, and what its posted sends still reference (:func:`sends_held`).

:func:`profile` runs one micro-batch through the user's Sequential, layer by layer, under torch's
``MemTracker`` (per layer: the peak of its forward and of its backward above what was live before)
and a saved-tensor hook that names every storage a layer saves, so that a stage's saved set is the
union over its layers (a tensor one layer returns and the next saves counts once). Under
``fake=True`` the same runs on fake tensors (nothing allocated) and times come from FLOP counts.
:func:`predict` walks each stage through its op order with those numbers.

Stages are modelled as on separate devices (a stage's input is its own copy, as between GPUs);
stages placed on one device add up. The batch's own input tensors are the data loader's and are
not counted.
"""

import functools
import statistics
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import AbstractSet, Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.utils.flop_counter import FlopCounterMode

from pipeckpt._compat import (
    DeferredBatchNorm,
    FakeTensorMode,
    MemTracker,
    TorchDispatchMode,
    module_memory,
    sac_saved_ops,
    schedule_op_order,
    tree_flatten,
)
from pipeckpt._errors import config_error
from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.checkpointing.order import kept as kept_microbatches
from pipeckpt.checkpointing.selective import run_selective
from pipeckpt.sizes import OPTIMIZERS
from pipeckpt.stages.gradients import gradients_set_aside
from pipeckpt.stages.guards import side_effect_free
from pipeckpt.stages.partition import StagePlan

__all__ = [
    "LayerProfile",
    "ModelProfile",
    "StageMemory",
    "Prediction",
    "profile",
    "predict",
    "optimizer_state_bytes",
    "op_order",
    "sends_held",
    "predict_device",
    "DeviceMemory",
    "SCHEDULES",
    "OPTIMIZERS",
]

#: Schedules the model knows: the local engine, and torch's single-stage schedules by name.
SCHEDULES = ("local", "gpipe", "1f1b")


Loss = Callable[[Tensor, Any], Tensor]


# --------------------------------------------------------------------------- profile


@dataclass(frozen=True)
class LayerProfile:
    """One layer of the Sequential, for one micro-batch. Storages are named by integer ids that
    are unique within one :class:`ModelProfile`; their sizes are in ``ModelProfile.storage_bytes``."""

    name: str
    param_bytes: int
    param_tensors: int
    largest_param: int  # bytes of its largest parameter (the gradient summed out of place)
    inputs: Tuple[int, ...]  # storages of the layer's input tensors
    outputs: Tuple[int, ...]  # storages of its output tensors
    saved: Tuple[int, ...]  # storages it saves for backward (parameters excluded)
    forward_peak: int  # peak bytes allocated by its forward above what was live before it
    backward_peak: int  # peak bytes of its backward above what was live before it
    forward_s: float
    backward_s: float
    # Selective checkpointing (torch's SAC, checkpointing/selective.py): the storages of the outputs of
    # the ops its policy keeps, and the forward seconds those ops take (a selective recompute skips them).
    sac_kept: Tuple[int, ...] = ()
    sac_s: float = 0.0
    # Seconds selective checkpointing adds to this layer's forward + backward, as measured (None:
    # not measured, fake tensors): on a dispatch-bound layer SAC's per-op dispatch mode and the
    # checkpoint's hooks cost more than the recompute SAC saves (GPT d 64 block: 3.0x plain).
    sac_extra_s: Optional[float] = None
    # The same with the gradient that arrives for its output held until its backward is over, as
    # a Function's backward holds it while the layer that ends its segment runs inside (None: as
    # ``backward_peak``, not measured).
    backward_held_peak: Optional[int] = None


@dataclass(frozen=True)
class ModelProfile:
    """Every layer of one micro-batch's forward and backward, and the loss after the last layer."""

    layers: Tuple[LayerProfile, ...]
    storage_bytes: Dict[int, int]
    microbatch_size: int
    batch_inputs: Tuple[int, ...]  # the micro-batch's own storages (the data's, never counted)
    loss: Optional[LayerProfile] = None
    fake: bool = False

    def bytes_of(self, ids: Set[int]) -> int:
        return sum(self.storage_bytes[i] for i in ids if i not in self.batch_inputs)

    def saved_union(self, start: int, stop: int) -> Set[int]:
        out: Set[int] = set()
        for layer in self.layers[start:stop]:
            out.update(layer.saved)
        return out


class _Storages:
    """Names every storage it is shown with a small integer, remembering its size."""

    def __init__(self, exclude: Sequence[Tensor]) -> None:
        self._ids: Dict[int, int] = {}
        self._keep: List[Any] = []  # the storages, alive for as long as the profile runs
        self.bytes: Dict[int, int] = {}
        self._excluded = {id(t.untyped_storage()) for t in exclude}
        self._keep.extend(t.untyped_storage() for t in exclude)

    def ids(self, value: Any) -> Tuple[int, ...]:
        out = []
        for t in tree_flatten(value)[0]:
            if not isinstance(t, Tensor):
                continue
            st = t.untyped_storage()
            if id(st) in self._excluded:
                continue
            if id(st) not in self._ids:
                self._ids[id(st)] = len(self._ids)
                self._keep.append(st)
                self.bytes[self._ids[id(st)]] = st.nbytes()
            out.append(self._ids[id(st)])
        return tuple(dict.fromkeys(out))


class _LossLayer(nn.Module):
    """The loss as a module, so that MemTracker snapshots it like a layer."""

    def __init__(self, loss_fn: Loss, target: Any) -> None:
        super().__init__()
        self.loss_fn, self.target = loss_fn, target

    def forward(self, output: Tensor) -> Tensor:
        return self.loss_fn(output, self.target)


def _param_bytes(module: nn.Module) -> Tuple[int, int, int]:
    sizes = [p.numel() * p.element_size() for p in module.parameters() if p.requires_grad]
    return sum(sizes), len(sizes), max(sizes, default=0)


@contextmanager
def _state_kept(sequential: nn.Module) -> Iterator[None]:
    """The profile leaves no trace: buffers (BatchNorm statistics), RNG and gradients as they were."""
    buffers = {k: b.clone() for k, b in sequential.named_buffers()}
    with torch.random.fork_rng(), gradients_set_aside(sequential.parameters()):
        try:
            yield
        finally:
            with torch.no_grad():
                for k, b in sequential.named_buffers():
                    b.copy_(buffers[k])


class _Probe(nn.Module):
    """The layers (and loss) under one root, so that MemTracker names each by its own path
    (``layers.3``) even where several layers share a class; ``forward`` notes what each layer
    takes, returns and saves."""

    def __init__(self, layers: List[nn.Module], loss: Optional[_LossLayer], storages: _Storages) -> None:
        super().__init__()
        self.layers = nn.ModuleList([*layers, *([loss] if loss is not None else [])])
        self.storages = storages
        self.records: List[Dict[str, Any]] = []

    def pack(self, t: Tensor) -> Tensor:
        if self.records and "outputs" not in self.records[-1]:
            self.records[-1]["saved"].update(self.storages.ids(t))
        return t

    def forward(self, x: Any) -> Any:
        h = x
        for layer in self.layers:
            record: Dict[str, Any] = {"inputs": self.storages.ids(h), "saved": set(), "sac": set()}
            self.records.append(record)
            h = layer(h)
            record["outputs"] = self.storages.ids(h)
        return h


class _SacOutputs(TorchDispatchMode):
    """Notes, for the layer the probe is running, the storages of the outputs of the ops that
    selective checkpointing's policy keeps, and times every op (the ops SAC keeps apart)."""

    def __init__(self, probe: "_Probe") -> None:
        super().__init__()
        self.probe = probe
        self.saved_ops = frozenset(sac_saved_ops())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        took = time.perf_counter() - t0
        records = self.probe.records
        if records and "outputs" not in records[-1]:
            record = records[-1]
            kept = getattr(func, "overloadpacket", func) in self.saved_ops
            record["op_s"] = record.get("op_s", 0.0) + took
            if kept:
                record["sac"].update(self.probe.storages.ids(out))
                record["sac_op_s"] = record.get("sac_op_s", 0.0) + took
        return out


def _memory_pass(
    layers: List[nn.Module], x: Any, loss: Optional[_LossLayer], storages: _Storages
) -> Tuple[List[Dict[str, Any]], Tuple[int, ...]]:
    """Two forward and backward passes: one with a saved-tensor hook naming every storage each
    layer saves (and a dispatch mode naming what selective checkpointing would keep), one under
    MemTracker for each layer's peaks (apart: a hook that keeps the saved tensor changes when
    autograd frees it)."""
    batch_inputs = storages.ids(x)
    probe = _Probe(layers, loss, storages)
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, _unpack), _SacOutputs(probe):
        _forward_backward(probe, x)
    records, probe.records = probe.records, []
    tracker = MemTracker()
    with tracker:
        _forward_backward(probe, x)
    for module, record in zip(probe.layers, records):
        snap = module_memory(tracker, module)
        record["forward_peak"] = snap.get("Peak-Forward", 0) - snap.get("Pre-Forward", 0)
        record["backward_peak"] = snap.get("Peak-Backward", 0) - snap.get("Pre-Backward", 0)
    for record, held_peak in zip(records, _held_backward_peaks(probe, x)):
        record["backward_held_peak"] = held_peak
    return records, batch_inputs


def _held_backward_peaks(probe: "_Probe", x: Any) -> List[int]:
    """Each layer's backward peak above what was live before it, with the gradient that arrived
    for its output held through its backward. Plain autograd frees that gradient once the layer's
    first node has used it; the stage's Function (pipeckpt/stages/stage.py ``_Recompute``) holds it through
    the whole backward run inside it, and a layer ending a segment runs there. Every such gradient is
    held until the pass ends: one freed during a later layer's backward would lower that layer's
    peak below what was live before it. Measured, not added: where a layer's peak comes before its
    first node is done, holding the gradient changes nothing."""
    held: List[Tensor] = []
    handles = [m.register_forward_hook(_hold_output_gradient(held.append)) for m in probe.layers]
    tracker = MemTracker()
    try:
        with tracker:
            _forward_backward(probe, x)
    finally:
        for handle in handles:
            handle.remove()
        held.clear()
    out = []
    for module in probe.layers:
        snap = module_memory(tracker, module)
        out.append(snap.get("Peak-Backward", 0) - snap.get("Pre-Backward", 0))
    return out


def _hold_output_gradient(hold: Callable[[Tensor], None]) -> Callable[..., None]:
    def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
        for t in tree_flatten(output)[0]:
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(hold)

    return hook


def _forward_backward(module: nn.Module, x: Any) -> None:
    h = module(x)
    outputs = [t for t in tree_flatten(h)[0] if isinstance(t, Tensor) and t.requires_grad]
    del h
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def _unpack(t: Tensor) -> Tensor:
    return t


def _clock() -> Callable[[], float]:
    """The clock the timing passes read: on CPU with one torch thread, this process's CPU time,
    which a machine shared with other jobs does not inflate (the wall clock there counted every
    wait for a core: a GPT d 64 profile read 2.6x its step); else the wall clock (a GPU's kernels,
    several threads' overlap)."""
    if torch.cuda.is_available() or torch.get_num_threads() > 1:
        return time.perf_counter
    return time.process_time


def _timing_pass(
    layers: List[nn.Module], x: Any, loss: Optional[_LossLayer], rounds: int
) -> List[Tuple[float, float]]:
    """Median forward and backward seconds per layer over ``rounds`` (after one warm-up)."""
    modules = [*layers, *([loss] if loss is not None else [])]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    samples: List[List[Tuple[float, float]]] = [[] for _ in modules]
    clock = _clock()
    for r in range(rounds + 1):
        marks: List[float] = []
        handles = [m.register_full_backward_pre_hook(_marker(marks, sync, clock)) for m in modules]
        forward_s = []
        try:
            h = x
            for m in modules:
                sync()
                t0 = clock()
                h = m(h)
                sync()
                forward_s.append(clock() - t0)
            outputs = [t for t in tree_flatten(h)[0] if isinstance(t, Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            sync()
            marks.append(clock())
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
    clock = _clock()
    # The stage's own guard: a recompute leaves BatchNorm statistics as the forward left them.
    guard = functools.partial(side_effect_free, layer)
    runs = (lambda: layer(h), lambda: run_selective(layer, (h,), {}, recompute_guard=guard))
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
    layers: List[nn.Module], x: Any, loss: Optional[_LossLayer], flops_per_s: float
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


def profile(
    sequential: nn.Sequential,
    microbatch: Any,
    *,
    loss_fn: Optional[Loss] = None,
    target: Any = None,
    rounds: int = 3,
    fake: bool = False,
    flops_per_s: float = 100e12,
) -> ModelProfile:
    """Profiles one micro-batch (``microbatch``: the input of the Sequential, already cut to one
    micro-batch) through ``sequential``, layer by layer, in training mode.

    ``loss_fn(output, target)`` is the loss after the last layer (its memory sits on the last
    stage); without it, backward starts from a gradient of ones. ``fake=True``: ``sequential`` and
    ``microbatch`` were built under :func:`fake_mode` (a model larger than the machine); times are
    FLOPs / ``flops_per_s``. Module state, RNG and gradients are left as they were.
    """
    layers = list(sequential)
    loss = _LossLayer(loss_fn, target) if loss_fn is not None else None
    first = tree_flatten(microbatch)[0]
    size = int(first[0].shape[0]) if first and isinstance(first[0], Tensor) and first[0].dim() else 1
    exclude = [*sequential.parameters(), *sequential.buffers()]
    storages = _Storages(exclude)
    was_training = sequential.training
    sequential.train()
    try:
        with _state_kept(sequential):
            records, batch_inputs = _memory_pass(layers, microbatch, loss, storages)
        with _state_kept(sequential):
            if fake:
                times = _flop_pass(layers, microbatch, loss, flops_per_s)
            else:
                with warnings.catch_warnings():
                    # A first layer whose input needs no gradient (token ids): its backward mark
                    # fires with its output's gradient, which is what the timing wants.
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    times = _timing_pass(layers, microbatch, loss, rounds)
                    sac_extra = _selective_pass(layers, microbatch, rounds)
    finally:
        sequential.train(was_training)
    profiles = []
    for i, (record, (fwd, bwd)) in enumerate(zip(records, times)):
        module = loss if loss is not None and i == len(layers) else layers[i]
        pbytes, ptensors, largest = _param_bytes(module) if module is not None else (0, 0, 0)
        profiles.append(
            LayerProfile(
                name=type(module).__name__ if i < len(layers) else "loss",
                param_bytes=pbytes,
                param_tensors=ptensors,
                largest_param=largest,
                inputs=record["inputs"],
                outputs=record["outputs"],
                saved=tuple(sorted(record["saved"])),
                forward_peak=max(0, record["forward_peak"]),
                backward_peak=max(0, record["backward_peak"]),
                backward_held_peak=max(0, record["backward_held_peak"]),
                forward_s=fwd,
                backward_s=bwd,
                sac_kept=tuple(sorted(record["sac"])),
                sac_s=fwd * _sac_share(record, fake),
                sac_extra_s=None if fake or i >= len(layers) else sac_extra[i],
            )
        )
    return ModelProfile(
        layers=tuple(profiles[: len(layers)]),
        storage_bytes=dict(storages.bytes),
        microbatch_size=size,
        batch_inputs=batch_inputs,
        loss=profiles[len(layers)] if loss is not None else None,
        fake=fake,
    )


def _sac_share(record: Dict[str, Any], fake: bool) -> float:
    """The share of a layer's forward time spent in the ops SAC keeps. Fake tensors run no kernels:
    there the times come from FLOPs, which the kept ops (matrix products, attention) carry."""
    if fake:
        return 1.0 if record["sac"] else 0.0
    total = record.get("op_s", 0.0)
    return min(1.0, record.get("sac_op_s", 0.0) / total) if total > 0 else 0.0


@contextmanager
def fake_mode() -> Iterator[Any]:
    """Build a model and its micro-batch inside this to profile them without allocating them."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


# --------------------------------------------------------------------------- schedules


def op_order(schedule: str, *, stages: int, microbatches: int) -> Tuple[List[List[Tuple[str, int]]], str]:
    """Each stage's compute ops, ``("F" | "B", micro-batch)`` in the order it runs them, and
    where the order comes from. ``local``: torchgpipe's fill-drain, backward from the last
    micro-batch (one autograd pass over the whole batch). A torch schedule: its own op order
    (torch's schedule IR) where that lists every micro-batch once forward then once backward,
    else the order its ``_step_microbatches`` runs (stated in the returned source)."""
    m = microbatches
    if schedule == "local":
        order = [[("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))] for _ in range(stages)]
        return order, "torchgpipe fill-drain, backward from the last micro-batch"
    name = _schedule_name(schedule)
    cls = get_schedule_class(name)
    ir = schedule_op_order(cls, stages=stages, microbatches=m)
    if ir is not None and all(_valid(ir.get(r, []), m) for r in range(stages)):
        return [ir[r] for r in range(stages)], f"{cls.__name__}'s op order (torch's schedule IR)"
    if cls.__name__ == "Schedule1F1B":
        # _step_microbatches: min(m, stages - i) warm-up forwards, then backward/forward
        # alternately, then the remaining backwards (torch's IR misnumbers the last rank's).
        order = []
        for i in range(stages):
            warm = min(m, stages - i)
            ops = [("F", k) for k in range(warm)]
            f, b = warm, 0
            while b < m:
                ops.append(("B", b))
                b += 1
                if f < m:
                    ops.append(("F", f))
                    f += 1
            order.append(ops)
        return order, "Schedule1F1B: min(m, S - i) warm-up forwards, then 1B1F (its _step_microbatches)"
    order = [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(stages)]
    return order, f"{cls.__name__}: all forwards, then backwards from micro-batch 0"


def _schedule_name(schedule: str) -> str:
    if str(schedule).lower().replace("_", "") not in ("gpipe", "1f1b"):
        raise config_error(
            f"schedule={schedule!r}",
            f"the memory model knows {SCHEDULES}",
            "use 'local' (the local engine), 'gpipe' or '1f1b' (the distributed engine)",
        )
    return str(schedule).replace("_", "")


def _valid(ops: List[Tuple[str, int]], m: int) -> bool:
    forwards = [i for k, i in ops if k == "F"]
    backwards = [i for k, i in ops if k == "B"]
    if sorted(forwards) != list(range(m)) or sorted(backwards) != list(range(m)):
        return False
    done: Set[int] = set()
    for kind, i in ops:
        if kind == "F":
            done.add(i)
        elif i not in done:
            return False
    return True


# --------------------------------------------------------------------------- predict


@dataclass(frozen=True)
class StageMemory:
    """One stage's predicted memory (bytes) and time (seconds) per training step."""

    stage: int
    layers: Tuple[int, int]  # (start, stop) in the Sequential
    mode: str
    params: int
    grads: int  # held at the peak (all of them, unless the peak falls in the first backward)
    optimizer: int
    activations: int  # held for backward by the micro-batches in flight, at the peak
    boundary: int  # stage inputs, received gradients and loss buffers, at the peak
    working: int  # recompute and the running layer's own working set, at the peak
    peak: int  # params + grads + optimizer + the rest at the peak moment
    in_flight: int  # most micro-batches held at once
    recomputed: int  # micro-batches recomputed per step
    time_s: float  # the stage's own compute per step, recompute included
    peak_at: str  # the op at which the peak falls, e.g. "B3 layer 5"


@dataclass(frozen=True)
class Prediction:
    stages: Tuple[StageMemory, ...]
    step_time_s: float  # the schedule's makespan on one device per stage (or the sum, shared)
    schedule: str
    order_source: str
    chunks: int

    @property
    def peak(self) -> int:
        return max(s.peak for s in self.stages)


@dataclass(frozen=True)
class DeviceMemory:
    """One device's predicted peak (bytes) where it runs several stages (a looped schedule)."""

    stages: Tuple[StageMemory, ...]  # each stage's own walk, as if alone on the device
    params: int
    optimizer: int
    peak: int  # everything the device's stages hold at its worst op
    peak_at: str  # e.g. "stage 2 B3 layer 5"


def optimizer_state_bytes(
    optimizer: Union[str, torch.optim.Optimizer, type], param_bytes: int, tensors: int
) -> int:
    """State an optimizer keeps for ``tensors`` parameter tensors of ``param_bytes`` in all:
    SGD none, SGD with momentum one buffer, Adam(W) two moments and a 4-byte step per tensor."""
    name = _optimizer_name(optimizer)
    extra = 4 * tensors if name in ("adam", "adamw") else 0
    return int(OPTIMIZERS[name] * param_bytes) + extra


def _optimizer_name(optimizer: Union[str, torch.optim.Optimizer, type]) -> str:
    if isinstance(optimizer, torch.optim.Optimizer):
        if isinstance(optimizer, torch.optim.SGD):
            return "momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
        optimizer = type(optimizer)
    if isinstance(optimizer, type):
        optimizer = optimizer.__name__
    name = str(optimizer).lower()
    if name not in OPTIMIZERS:
        raise config_error(
            f"optimizer {optimizer!r}",
            f"the memory model knows the state of {list(OPTIMIZERS)}",
            "name one of those (or pass the optimizer object)",
        )
    return name


@dataclass
class _Cell:
    """What one micro-batch of one stage holds between its forward and its backward."""

    kept: int
    recompute: bool


@dataclass
class _Peak:
    value: int = -1
    parts: Tuple[int, int, int] = (0, 0, 0)  # activations, boundary, working
    at: str = ""
    in_flight: int = 0

    def see(self, value: int, parts: Tuple[int, int, int], at: str) -> None:
        if value > self.value:
            self.value, self.parts, self.at = value, parts, at


@dataclass
class _StageModel:
    """The per-micro-batch numbers of one stage, from the profile. Under the distributed engine
    the stage input lives in torch's receive buffer (counted apart), so it is left out here."""

    profile: ModelProfile
    start: int
    stop: int
    first: bool
    last: bool
    local: bool

    def __post_init__(self) -> None:
        p = self.profile
        self.layers = p.layers[self.start : self.stop]
        self.inputs: Set[int] = set() if self.first else set(self.layers[0].inputs)
        self.input_bytes = p.bytes_of(self.inputs)
        self.outputs: Set[int] = set(self.layers[-1].outputs)
        self.output_bytes = p.bytes_of(self.outputs)
        self.param_bytes = sum(layer.param_bytes for layer in self.layers)
        self.param_tensors = sum(layer.param_tensors for layer in self.layers)
        self.forward_s = sum(layer.forward_s for layer in self.layers)
        self.backward_s = sum(layer.backward_s for layer in self.layers)

    def bytes(self, ids: Set[int]) -> int:
        return self.profile.bytes_of(ids if self.local else ids - self.inputs)

    def segments(self, mode: CheckpointMode, recompute: bool) -> List[Tuple[int, int]]:
        """The layer ranges (absolute) a micro-batch is checkpointed in: one segment of the whole
        stage, or runs of ``mode.every`` layers when it is recomputed granularly (pipeckpt/stages/stage.py
        ``_granular``: ``:k``, and ``+selective`` with or without ``:k``)."""
        if not recompute or (mode.every is None and not mode.selective):
            return [(self.start, self.stop)]
        every = mode.every or (self.stop - self.start)
        return [(a, min(a + every, self.stop)) for a in range(self.start, self.stop, every)]

    def _segment_input(self, a: int) -> Set[int]:
        return set(self.inputs) if a == self.start else set(self.profile.layers[a].inputs)

    def _kept_through(self, mode: CheckpointMode, segments: Sequence[Tuple[int, int]]) -> Set[int]:
        """What the checkpointed ``segments`` keep from forward to backward: each one's input and,
        selective, the outputs of the ops SAC keeps (pipeckpt/checkpointing/selective.py)."""
        held: Set[int] = set(self.inputs)
        for a, b in segments:
            held |= self._segment_input(a)
            if mode.selective:
                # SAC runs inside the stage's Function, which keeps the segment's input and output.
                held |= set(self.profile.layers[b - 1].outputs)
                for layer in self.profile.layers[a:b]:
                    held |= set(layer.sac_kept)
        return held

    def kept(
        self, mode: CheckpointMode, recompute: bool, *, function: bool = True, output: bool = False
    ) -> int:
        """Bytes one micro-batch holds from its forward to its backward (without the stage's
        Function, its output only where a layer saved it). ``output``: the stage's output is held
        besides (torch's PipelineStage keeps each micro-batch's output until its backward); a
        storage a layer also saves counts once."""
        return self.bytes(self.kept_ids(mode, recompute, function=function, output=output))

    def kept_ids(
        self, mode: CheckpointMode, recompute: bool, *, function: bool = True, output: bool = False
    ) -> Set[int]:
        """The storages :meth:`kept` counts."""
        if not recompute:
            ids = self.profile.saved_union(self.start, self.stop)
            if function:
                ids |= self.outputs | self.inputs
        else:
            ids = self._kept_through(mode, self.segments(mode, recompute))
        return ids | self.outputs if output else ids

    def forward_live(self, mode: CheckpointMode, recompute: bool) -> List[Tuple[int, int]]:
        """(held by this micro-batch, the layer's own forward peak) while each layer runs forward:
        a kept micro-batch keeps what each layer saved; a recomputed one its segments' inputs (and
        selective, the outputs SAC keeps) so far."""
        out = []
        held: Set[int] = set(self.inputs)
        for a, b in self.segments(mode, recompute):
            held |= self._segment_input(a)
            for layer in self.profile.layers[a:b]:
                out.append((self.bytes(held | set(layer.inputs)), layer.forward_peak))
                if not recompute:
                    held |= set(layer.saved)
                elif mode.selective:
                    held |= set(layer.sac_kept)
            if recompute and mode.selective:
                held |= set(self.profile.layers[b - 1].outputs)
        return out

    def backward_events(
        self, mode: CheckpointMode, recompute: bool, *, function: bool = True, output: bool = False
    ) -> List[Tuple[Any, ...]]:
        """One micro-batch's backward, segment by segment from the last: a recomputed segment first
        runs forward again, ``("R", layer, held, forward peak)``, keeping what its layers save; then
        each layer's backward, last first, ``("B", layer, held, arriving, backward peak, grads of
        the stage's layers after it, last segment?, segment's last layer?)``. While a segment runs
        backward, the earlier segments still keep what they kept, and the segment's output and the
        gradient that arrived for it stay held: its Function's backward holds both while autograd
        runs inside it (whole stage: the stage's output and its incoming gradient). ``output``: the
        stage's output from the forward is held throughout besides (torch's PipelineStage): counted
        once with what holds it already, and apart from the new output a recompute makes."""
        p = self.profile
        segments = self.segments(mode, recompute)
        outs: Set[int] = set()  # held from the forward: counted once with the rest
        extra = 0  # held from the forward beside a recompute's own copy
        if output and recompute:
            extra = self.bytes(self.outputs - self._kept_through(mode, segments))
        elif output:
            outs = set(self.outputs)
        out: List[Tuple[Any, ...]] = []
        for n in reversed(range(len(segments))):
            a, b = segments[n]
            if recompute:
                before = self._kept_through(mode, segments[: n + 1])
            else:  # the Function holds the stage's input; plain autograd only what a layer saved
                before = set(self.inputs) if function else set()
            if recompute:
                held = set(before)
                if mode.selective:
                    # SAC's cache hands each kept output to the recompute as its op runs again (and
                    # drops it there): the recompute keeps only what autograd saves, so an output
                    # still held is one of a layer not yet run again. The segment's output has gone
                    # before the recompute starts (the Function drops it) unless such a layer's op
                    # made it; its gradient is held instead (the walk adds it).
                    before = self._kept_through(mode, segments[:n]) | self._segment_input(a)
                    held = set(before)
                for k in range(a, b):
                    layer = p.layers[k]
                    work = layer.forward_peak
                    pending: Set[int] = set()  # SAC's kept outputs of this layer and the ones after it
                    if mode.selective:  # SAC hands back the outputs it kept instead of computing them
                        work = max(0, work - p.bytes_of(set(layer.sac_kept)))
                        pending = set().union(*(set(x.sac_kept) for x in p.layers[k:b]))
                    last_segment, seg_out = n == len(segments) - 1, p.bytes_of(set(p.layers[b - 1].outputs))
                    now = held | pending | set(layer.inputs)
                    out.append(("R", k, self.bytes(now) + extra, work, last_segment, seg_out))
                    held |= set(layer.saved)
            # Nothing holds the segment's output through its backward unless a layer saved it: the
            # stage's Function starts the backward inside from the output's gradient edge and drops
            # the output first (pipeckpt/stages/stage.py ``_Recompute._roots``); without the Function (one
            # kept micro-batch) autograd walks the graph itself.
            for k in reversed(range(a, b)):
                layer = p.layers[k]
                held = before | p.saved_union(a, k + 1)
                after = sum(x.param_bytes for x in p.layers[k + 1 : self.stop])
                own = p.bytes_of(set(layer.outputs))
                out.append(
                    (
                        "B",
                        k,
                        self.bytes(held | outs) + extra,
                        own,
                        layer.backward_peak,
                        after,
                        n == len(segments) - 1,
                        k == b - 1,
                        layer.largest_param,
                    )
                )
        return out

    def recompute_s(self, mode: CheckpointMode) -> float:
        """Seconds one recomputed micro-batch's forward takes again: the whole stage, or under
        selective all but the ops SAC kept."""
        if mode.selective:
            return sum(
                max(0.0, layer.forward_s - layer.sac_s) if layer.sac_extra_s is None else layer.sac_extra_s
                for layer in self.layers
            )
        return self.forward_s


def predict(
    profile: ModelProfile,
    plan: StagePlan,
    *,
    chunks: int,
    optimizer: Union[str, torch.optim.Optimizer, type] = "adam",
    schedule: str = "local",
    accumulating: bool = False,
    shared_device: bool = False,
) -> Prediction:
    """Per-stage memory and step time of ``plan`` (its balance and modes) with ``chunks``
    micro-batches of the profiled size, under ``schedule`` (``local``, ``gpipe`` or ``1f1b``).

    ``accumulating``: ``.grad`` already holds gradients when the step starts (gradient
    accumulation), so they count from the first op. ``shared_device``: every stage runs on one
    device (the local engine on CPU), so the step time is the sum of the stages' times.
    """
    if sum(plan.balance) != len(profile.layers):
        raise config_error(
            f"balance {list(plan.balance)} (sum {sum(plan.balance)})",
            f"the profile has {len(profile.layers)} layers",
            "profile the same Sequential the plan cuts",
        )
    stages = plan.stages
    order, source = op_order(schedule, stages=stages, microbatches=chunks)
    local = schedule == "local"
    out, times = [], []
    for j, ((start, stop), mode) in enumerate(zip(plan.ranges, plan.modes)):
        model = _StageModel(profile, start, stop, first=j == 0, last=j == stages - 1, local=local)
        keep = kept_microbatches([(j, kind, i) for kind, i in order[j]], j)
        out.append(
            _predict_stage(
                model,
                j,
                mode,
                order[j],
                chunks=chunks,
                keep=keep,
                optimizer=optimizer,
                accumulating=accumulating,
                sends=sends_held(schedule, order[j], stages=stages, stage=j),
            )
        )
        times.append(_op_times(model, mode, chunks, keep))
    step = sum(s.time_s for s in out) if shared_device else _makespan(order, times, local=local)
    return Prediction(
        stages=tuple(out), step_time_s=step, schedule=schedule, order_source=source, chunks=chunks
    )


def predict_device(
    profile: ModelProfile,
    plan: StagePlan,
    *,
    chunks: int,
    order: Sequence[Tuple[int, str, int]],
    optimizer: Union[str, torch.optim.Optimizer, type] = "adam",
    accumulating: bool = False,
) -> DeviceMemory:
    """The peak of one device that runs several stages of ``plan`` under a looped torch schedule
    (``interleaved_1f1b``, ``looped_bfs``): ``order`` is the device's ops ``(stage, "F" | "B",
    micro-batch)`` as the schedule runs them (its own ``pipeline_order`` for this rank:
    :func:`pipeckpt._compat.live_op_order`). While one stage runs an op, the device's other stages
    hold what they hold between ops (parameters, optimizer state, gradients once made, receive
    buffers, their micro-batches in flight) and what their sends still reference: measured on
    gloo, every output and input gradient a looped schedule sends (in batches that mix sends and
    receives) stays alive until the step ends, as under GPipe. ``except_last`` keeps what
    :func:`pipeckpt.checkpointing.order.kept` reads off the device's order, as the stages do."""
    if sum(plan.balance) != len(profile.layers):
        raise config_error(
            f"balance {list(plan.balance)} (sum {sum(plan.balance)})",
            f"the profile has {len(profile.layers)} layers",
            "profile the same Sequential the plan cuts",
        )
    unknown = sorted({kind for _, kind, _ in order} - {"F", "B"})
    if unknown:
        raise config_error(
            f"an op order with {unknown} ops",
            "the model knows whole backwards (F and B); a split backward (I, W) runs without recompute",
            "predict a schedule whose backward is whole (interleaved_1f1b, looped_bfs)",
        )
    ops = [(j, kind, i) for j, kind, i in order]
    walks: Dict[int, _StageWalk] = {}
    for j in sorted({j for j, _, _ in ops}):
        start, stop = plan.ranges[j]
        model = _StageModel(profile, start, stop, first=j == 0, last=j == plan.stages - 1, local=False)
        walks[j] = _StageWalk(
            model,
            j,
            plan.modes[j],
            chunks=chunks,
            keep=kept_microbatches(ops, j),
            optimizer=optimizer,
            accumulating=accumulating,
        )
        walks[j].hold_sends = True
    device = _Peak()
    for j, kind, i in ops:
        around = sum(w.resting() for k, w in walks.items() if k != j)
        walks[j].run(kind, i, device=device, around=around)
    stages = tuple(w.result() for w in walks.values())
    return DeviceMemory(
        stages=stages,
        params=sum(st.params for st in stages),
        optimizer=sum(st.optimizer for st in stages),
        peak=device.value,
        peak_at=device.at,
    )


def sends_held(
    schedule: str, ops: Sequence[Tuple[str, int]], *, stages: int, stage: int
) -> List[Tuple[int, int]]:
    """For each op of stage ``stage``'s order: how many outputs and how many input gradients of
    micro-batches whose backward is over are still alive while it runs, referenced by the sends
    torch's schedule posted (a send's op or work keeps its tensor until dropped). Read from
    torch's ``_step_microbatches``: GPipe keeps every forward and backward send until the step
    ends, so the k-th backward runs beside k outputs and k gradients; 1F1B keeps the latest
    backward's send until the next backward is over (one gradient from the first backward on),
    and the send of the next-to-last warm-up forward (micro-batch ``warm - 2``) until its
    one-backward-one-forward phase ends. The local engine sends nothing. Which of these a stage
    has (no output sent from the last, no gradient from the first) is the caller's to apply."""
    name = str(schedule).lower().replace("_", "")
    out: List[Tuple[int, int]] = []
    if name == "local":
        return [(0, 0)] * len(ops)
    warm = min(sum(1 for k, _ in ops if k == "F"), stages - stage)
    last_forward = max(n for n, (k, _) in enumerate(ops) if k == "F")
    warm_send = warm - 2  # 1F1B: the warm-up forward whose send stays referenced, if any
    backwards: Set[int] = set()
    phase_over = False  # 1F1B: the backward after the last forward has run
    for n, (kind, i) in enumerate(ops):
        if name == "gpipe":
            out.append((len(backwards), len(backwards)) if kind == "B" else (0, 0))
        else:
            outputs = int(warm_send >= 0 and warm_send in backwards and not phase_over)
            out.append((outputs, int(bool(backwards))))
        if kind == "B":
            backwards.add(i)
            phase_over = phase_over or n > last_forward
    return out


def _predict_stage(
    s: _StageModel,
    j: int,
    mode: CheckpointMode,
    ops: List[Tuple[str, int]],
    *,
    chunks: int,
    keep: AbstractSet[int],
    optimizer: Union[str, torch.optim.Optimizer, type],
    accumulating: bool,
    sends: Optional[Sequence[Tuple[int, int]]] = None,
) -> StageMemory:
    """Walks the stage through its ops, keeping the largest total seen. ``keep``: the micro-batches
    ``except_last`` keeps under this schedule (``checkpointing.order.kept`` of the stage's order);
    ``sends``: per op, the outputs and input gradients sends still hold (:func:`sends_held`)."""
    walk = _StageWalk(s, j, mode, chunks=chunks, keep=keep, optimizer=optimizer, accumulating=accumulating)
    for n, (kind, i) in enumerate(ops):
        walk.run(kind, i, sent=sends[n] if sends is not None else (0, 0))
    return walk.result()


class _StageWalk:
    """One stage's memory, op by op: what it holds between ops (:meth:`resting`) and the totals
    while one of its ops runs (:meth:`run`), seen by its own peak and, where several stages share
    a device, by the device's (``around``: what the device's other stages hold meanwhile)."""

    def __init__(
        self,
        s: _StageModel,
        j: int,
        mode: CheckpointMode,
        *,
        chunks: int,
        keep: AbstractSet[int],
        optimizer: Union[str, torch.optim.Optimizer, type],
        accumulating: bool,
    ) -> None:
        self.s, self.j, self.mode, self.m, self.keep = s, j, mode, chunks, keep
        m, local = chunks, s.local
        self.grads = s.param_bytes
        self.opt = optimizer_state_bytes(optimizer, s.param_bytes, s.param_tensors)
        self.static = s.param_bytes + self.opt
        self.loss = s.profile.loss if s.last else None
        self.loss_saved = s.profile.bytes_of(set(self.loss.saved)) if self.loss is not None else 0
        # The distributed engine: torch's PipelineStage keeps a receive buffer per micro-batch for
        # activations (not on the first stage) and gradients (not on the last), and each
        # micro-batch's output until its backward.
        self.recv = 0 if local else m * (s.input_bytes + (0 if s.last else s.output_bytes))
        # One micro-batch that is not recomputed runs without the stage's Function (pipeckpt/stages/stage.py).
        self.function = {r: r or m > 1 for r in (False, True)}
        self.kept_ids_of = {
            r: s.kept_ids(mode, r, function=self.function[r], output=not local) for r in (False, True)
        }
        self.kept_of = {r: s.bytes(ids) for r, ids in self.kept_ids_of.items()}
        self.forward = {r: s.forward_live(mode, r) for r in (False, True)}
        self.backward = {
            r: s.backward_events(mode, r, function=self.function[r], output=not local) for r in (False, True)
        }
        # The gradient arriving for the stage's output: the receive buffer (distributed, counted in
        # recv), a view of the gathered batch's (local, last stage: the tail, freed with the last
        # micro-batch's view); else a copy of its own. It stays held while the stage's last
        # segment runs backward; an earlier segment holds the gradient the segment after it made.
        self.stage_incoming = 0 if s.last == local else s.output_bytes
        self.cells: Dict[int, int] = {}  # micro-batch -> bytes it holds until its backward
        self.peak, self.most = _Peak(), 0
        self.grads_done = accumulating
        self.tail = 0  # local engine, last stage: the gathered batch's output gradient
        self.device: Optional[_Peak] = None
        self.around = 0
        self.backwards = 0  # micro-batches whose backward is over
        self.hold_sends = False  # every send lives until the step ends (a looped schedule's)

    def resting(self) -> int:
        """Bytes the stage holds while another stage of its device runs."""
        g_now = self.grads if self.grads_done else 0
        resting = self.static + g_now + self.recv + sum(self.cells.values()) + self.tail
        return resting + self._sent_bytes(self._held_sends())

    def _held_sends(self) -> Tuple[int, int]:
        return (self.backwards, self.backwards) if self.hold_sends else (0, 0)

    def _sent_bytes(self, sent: Tuple[int, int]) -> int:
        outputs, gradients = sent
        return outputs * (0 if self.s.last else self.s.output_bytes) + gradients * self.s.input_bytes

    def _see(self, value: int, parts: Tuple[int, int, int], at: str) -> None:
        self.peak.see(value, parts, at)
        if self.device is not None:
            self.device.see(value + self.around, parts, f"stage {self.j} {at}")

    def run(
        self,
        kind: str,
        i: int,
        *,
        sent: Tuple[int, int] = (0, 0),
        device: Optional[_Peak] = None,
        around: int = 0,
    ) -> None:
        """One op, ``("F" | "B", micro-batch)``. ``sent``: the outputs and input gradients of
        finished micro-batches the schedule's sends still hold (:func:`sends_held`)."""
        s, mode, m, local, loss = self.s, self.mode, self.m, self.s.local, self.loss
        self.device, self.around = device, around
        static, recv, grads, cells, peak_see = self.static, self.recv, self.grads, self.cells, self._see
        recompute = mode.recomputes(i, m, keep=self.keep)
        g_now = grads if self.grads_done else 0
        others = sum(cells.values())
        if self.hold_sends:
            sent = self._held_sends()
        recv_now = recv + self._sent_bytes(sent)  # the receive buffers, and what earlier sends still hold
        base = static + g_now + recv_now + others
        if kind == "F":
            # torchgpipe's clock: the next stage takes micro-batch i - 1's output one clock later,
            # after this stage's forward of micro-batch i; the last stage's wait for the gather.
            waiting = (i if s.last else min(i, 1)) * s.output_bytes if local else 0
            for k, (mine, work) in enumerate(self.forward[recompute]):
                parts = (others + mine, recv_now + waiting, work)
                peak_see(base + waiting + mine + work, parts, f"F{i} layer {s.start + k}")
            cells[i] = self.kept_of[recompute]
            if loss is not None and not local:  # torch computes each micro-batch's loss at once
                peak_see(
                    base + cells[i] + loss.forward_peak,
                    (others + cells[i], recv_now, loss.forward_peak),
                    f"F{i} loss",
                )
                cells[i] += self.loss_saved
            self.most = max(self.most, len(cells))
            if local and s.last and len(cells) == m:
                # The whole batch at once: gathered outputs, loss forward and backward.
                acts, gathered = sum(cells.values()), m * s.output_bytes
                total = static + g_now + acts
                # One micro-batch is handed back as it is, no copy (LocalPipeline._gather): the
                # output, and what the loss saves of it, count once with what the micro-batch holds.
                held = self.kept_ids_of[recompute] if m == 1 else set()
                joined = s.bytes(s.outputs - held) if m == 1 else 2 * gathered
                peak_see(total + joined, (acts, joined, 0), "gather")
                if loss is not None:
                    joined = s.bytes(s.outputs - held) if m == 1 else gathered
                    work = m * loss.forward_peak
                    peak_see(total + joined + work, (acts, joined, work), "loss forward")
                    work = m * loss.backward_peak
                    ls = s.profile.bytes_of(set(loss.saved) - held) if m == 1 else m * self.loss_saved
                    peak_see(total + ls + work, (acts, ls, work), "loss backward")
                self.tail = gathered
            return
        kept = cells.pop(i)
        base -= kept
        if local and self.backwards:
            # The input gradient the previous backward (micro-batch i + 1) made waits in autograd's
            # buffer for the stage before until this backward is over: on one autograd pass, the
            # engine runs the nodes made later first, and this stage's forward of micro-batch i
            # came after the previous stage's of micro-batch i + 1 (torchgpipe's clock).
            recv_now += s.input_bytes
            base += s.input_bytes
        others = sum(cells.values())
        if loss is not None and not local:
            peak_see(
                base + kept + loss.backward_peak, (others + kept, recv_now, loss.backward_peak), f"B{i} loss"
            )
        done = 0  # layers of this micro-batch backwarded so far
        function = self.function[recompute]
        for event in self.backward[recompute]:
            # The tail goes with the last micro-batch's view of it: under the stage's Function, when
            # the last segment's backward returns (autograd's engine holds the gradient it hands a
            # Function until then); in plain autograd, once the last layer's node has used it.
            if not cells and (not event[4 if event[0] == "R" else 6] if function else done == 1):
                self.tail = 0
            if event[0] == "R":
                # The gradient for the segment's output has arrived before its recompute starts.
                _, k, mine, work, last_segment, seg_out = event
                incoming = self.stage_incoming if last_segment else seg_out
                peak_see(
                    base + self.tail + incoming + mine + work,
                    (others + mine, recv_now + self.tail + incoming, work),
                    f"B{i} recompute layer {k}",
                )
                continue
            _, k, saved, own, work, after, last_segment, segment_end, _ = event
            g = grads if self.grads_done else after
            # Each micro-batch adds its gradients into .grad in place (pipeckpt/stages/stage.py), so
            # no sum over micro-batches waits beside .grad.
            incoming = (
                self.stage_incoming if last_segment else s.profile.bytes_of(set(s.profile.layers[k].outputs))
            )
            if not function:  # each gradient goes once its node has used it
                # The stage's last layer gets the stage's incoming gradient (the tail's view, which
                # the tail counts, on the local engine's last stage).
                arriving = incoming if last_segment and segment_end else own
            elif segment_end:
                arriving = incoming
            else:
                arriving = own + incoming
            if function and segment_end:
                # The Function holds the gradient for the segment's output through the whole
                # backward inside it, beyond the layer's first node (plain autograd frees it there).
                held_peak = s.profile.layers[k].backward_held_peak
                work = work if held_peak is None else held_peak
            total = static + recv_now + others + g + saved + self.tail + arriving + work
            parts = (others + saved, recv_now + self.tail + arriving, work)
            peak_see(total, parts, f"B{i} layer {k}")
            done += 1
        self.grads_done = True
        self.backwards += 1

    def result(self) -> StageMemory:
        s, mode, m, keep, peak = self.s, self.mode, self.m, self.keep, self.peak
        acts, boundary, working = peak.parts
        held_grads = peak.value - self.static - acts - boundary - working  # the rest of every total
        recomputed = sum(1 for i in range(m) if mode.recomputes(i, m, keep=keep))
        time_s = sum(_op_times(s, mode, m, keep).values())
        return StageMemory(
            stage=self.j,
            layers=(s.start, s.stop),
            mode=mode.name,
            params=s.param_bytes,
            grads=held_grads,
            optimizer=self.opt,
            activations=acts,
            boundary=boundary,
            working=working,
            peak=peak.value,
            in_flight=self.most,
            recomputed=recomputed,
            time_s=time_s,
            peak_at=peak.at,
        )


def _op_times(
    s: _StageModel, mode: CheckpointMode, m: int, keep: AbstractSet[int]
) -> Dict[Tuple[str, int], float]:
    loss = s.profile.loss if s.last else None
    lf = loss.forward_s if loss is not None else 0.0
    lb = loss.backward_s if loss is not None else 0.0
    out = {}
    for i in range(m):
        out[("F", i)] = s.forward_s + lf
        out[("B", i)] = s.backward_s + lb + (s.recompute_s(mode) if mode.recomputes(i, m, keep=keep) else 0.0)
    return out


def _makespan(
    order: List[List[Tuple[str, int]]], times: List[Dict[Tuple[str, int], float]], *, local: bool
) -> float:
    """The step's length with one device per stage: each stage runs its ops in order, a forward
    after the previous stage's forward of that micro-batch, a backward after the next stage's
    backward (the last stage's after its own forward, and under the local engine after every
    forward: one backward pass over the gathered batch)."""
    stages = len(order)
    end: Dict[Tuple[str, int, int], float] = {}
    position = [0] * stages
    clock = [0.0] * stages
    last_forwards = [("F", stages - 1, i) for k, i in order[-1] if k == "F"]
    while any(position[j] < len(order[j]) for j in range(stages)):
        progressed = False
        for j in range(stages):
            if position[j] >= len(order[j]):
                continue
            kind, i = order[j][position[j]]
            if kind == "F":
                deps = [("F", j - 1, i)] if j > 0 else []
            elif j < stages - 1:
                deps = [("B", j + 1, i)]
            else:
                deps = list(last_forwards) if local else [("F", j, i)]
            if any(d not in end for d in deps):
                continue
            start = max([clock[j], *(end[d] for d in deps)])
            clock[j] = start + times[j][(kind, i)]
            end[(kind, j, i)] = clock[j]
            position[j] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"op orders deadlock: {order}")
    return max(clock) if clock else 0.0


def with_modes(plan: StagePlan, modes: Sequence[CheckpointMode]) -> StagePlan:
    """``plan`` with other modes (balance and devices kept)."""
    return replace(plan, modes=tuple(modes))


def with_balance(plan: StagePlan, balance: Sequence[int], modes: Sequence[CheckpointMode]) -> StagePlan:
    devices = plan.devices if len(plan.devices) == len(balance) else (plan.devices[0],) * len(balance)
    return StagePlan(balance=tuple(balance), devices=tuple(devices), modes=tuple(modes))
