"""Hooks that time and weigh each stage during one training step, with any engine.

Why hooks on the user's layers and on pipeckpt's :class:`~pipeckpt.stages.stage.Stage` modules
rather than the profiler or hooks on every autograd node: they work under any engine and cost a
few hooks per micro-batch (``benchmarks/RESULTS.md``, "Report cost"). Backward is the run time of
the stage's few checkpoint-Function nodes; memory is the peak of what a stage's forwards and
recomputes allocate on its device, seen by a dispatch mode entered in every layer's hooks, since
saved-tensor hooks and dispatch modes are thread-local (docs/ARCHITECTURE.md, "report/probe.py").
"""

import threading
import time
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import lightning as L
import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torchgpipe import is_recomputing

from pipeckpt._compat import TorchDispatchMode, tree_flatten

if TYPE_CHECKING:
    from pipeckpt.stages.stage import Stage

__all__ = ["StageProbe", "pipeline_layers", "settled_clock"]


class _Ledger:
    """Live and peak bytes of the storages each stage allocated, shared by threads."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        # Re-entrant: a storage freed by garbage collection inside ``allocated``
        # runs its weak-reference callback, ``_freed``, in the same thread.
        self._lock = threading.RLock()
        self._seen: dict[int, weakref.ref] = {}
        self.live: dict[int, int] = defaultdict(int)
        self.peak: dict[int, int] = defaultdict(int)

    def allocated(self, stage: int, storage: torch.UntypedStorage) -> None:
        if storage.device != self.devices[stage]:
            return
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._seen:
                return
            self._seen[key] = weakref.ref(storage, lambda _: self._freed(key, stage, nbytes))
            self.live[stage] += nbytes
            self.peak[stage] = max(self.peak[stage], self.live[stage])

    def _freed(self, key: int, stage: int, nbytes: int) -> None:
        with self._lock:
            self._seen.pop(key, None)
            self.live[stage] -= nbytes


def _storages(tree: Any) -> dict[int, torch.UntypedStorage]:
    leaves, _ = tree_flatten(tree)
    return {
        id(s): s for s in (t.untyped_storage() for t in leaves if isinstance(t, Tensor)) if s.nbytes() > 0
    }


class _AllocationProbe(TorchDispatchMode):
    """Charges every storage that an op newly allocates to one stage."""

    def __init__(self, ledger: _Ledger, stage: int) -> None:
        super().__init__()
        self.ledger = ledger
        self.stage = stage

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        existing = _storages((args, kwargs))
        for key, storage in _storages(out).items():
            if key not in existing:
                self.ledger.allocated(self.stage, storage)
        return out


def settled_clock(device: torch.device) -> float:
    """The host clock once ``device`` has finished its queued work (step boundaries only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


Mark = Any  # a host time (float) or a recorded torch.cuda.Event


def _mark(device: torch.device) -> Mark:
    """A point in ``device``'s time, without waiting for it: a CUDA event on the current stream,
    or the host clock (CPU work has finished when the host reaches the hook)."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def _seconds(start: Mark, end: Mark) -> float:
    """Seconds between two marks; CUDA events must have completed (synchronise first)."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


def _device_of(args: tuple[Any, ...]) -> torch.device:
    first = args[0] if args else None
    return first.device if isinstance(first, Tensor) else torch.device("cpu")


class StageProbe:
    """Hooks on the user's layers (and on pipeckpt's stage modules, when given) that time and
    weigh each stage during one step; :meth:`remove` them, then :meth:`resolve` the times.

    Args:
        layers: the user's pipeline Sequential.
        ranges: each stage's layers, as ``(first, stop)``.
        devices: each stage's device.
        memory: whether to measure activation memory too (slower).
        stages: pipeckpt's Stage modules, timed at their boundary when the engine calls them
            (a ``pipeline_of`` engine calls their layers one by one instead).
        count_layers: False when the engine is known to call every one of ``stages`` (a step
            measured before said so): their own lists of checkpointed micro-batches count the
            recomputes, with no hook on their layers; True: every layer counts its reruns.
    """

    def __init__(
        self,
        layers: nn.Sequential,
        ranges: list[tuple[int, int]],
        devices: list[torch.device],
        *,
        memory: bool,
        stages: Sequence["Stage"] = (),
        count_layers: bool = True,
    ) -> None:
        self.memory = memory
        self.ledger = _Ledger(devices)
        self.forward_s: dict[int, float] = defaultdict(float)
        self.backward_s: dict[int, float] = defaultdict(float)
        # Runs of each layer while recomputing, per stage: a micro-batch reruns each layer at
        # most once, and under a per-layer mode some layers (a parameter-free first layer whose
        # input needs no gradient) are not rerun at all, so the stage's count is the maximum.
        self._reruns: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self._checkpointed: dict[int, int] = {}
        # (stage, forward?, start mark, end mark), read by resolve() at the end of the step
        self._spans: list[tuple[int, bool, Mark, Mark]] = []
        self._devices = devices
        # Leaves (parameters, a stage's phony) whose accumulator node is timed already this step:
        # one node serves every micro-batch, and a second pair of hooks would count it twice.
        # Keyed by the leaf's id: leaves live through the step; no node is referenced here.
        self._leaves: set[int] = set()
        self._covered: set[int] = set()  # stages timed by their Stage module's hooks this step
        self._stages = {stage.index: stage for stage in stages} if not count_layers else {}
        self._local = threading.local()
        self._handles: list[Any] = []
        children = list(layers)
        for module in stages:
            index = module.index
            self._handles.append(module.register_forward_pre_hook(self._enter_stage(index)))
            self._handles.append(module.register_forward_hook(self._leave_stage(index)))
        for stage, (first, stop) in enumerate(ranges):
            # A stage known to run through its Stage module is timed and counted there alone.
            by_layers = stage not in self._stages
            if by_layers:
                self._handles.append(children[first].register_forward_pre_hook(self._enter(stage)))
                self._handles.append(children[stop - 1].register_forward_hook(self._leave(stage)))
            for position, layer in enumerate(children[first:stop]):
                if by_layers:
                    self._handles.append(layer.register_forward_pre_hook(self._rerun(stage, position)))
                    self._handles.append(layer.register_forward_hook(self._reran(stage, position)))
                if memory:
                    # One dispatch mode per layer call, left even when the layer raises:
                    # a checkpoint recompute stops with an exception once it has what it needs.
                    self._handles.append(layer.register_forward_pre_hook(self._push(stage)))
                    self._handles.append(layer.register_forward_hook(self._pop, always_call=True))

    @property
    def hooks(self) -> int:
        """The hooks registered now."""
        return len(self._handles)

    @property
    def covered(self) -> frozenset[int]:
        """The stages this step timed at their Stage module (the engine called it)."""
        return frozenset(self._covered)

    @property
    def recomputed(self) -> dict[int, int]:
        """Micro-batches each stage checkpointed, i.e. reran (wholly or some of its layers) in
        backward: a Stage module's own count (read before its next step resets it), else the
        runs of the stage's most-rerun layer."""
        counts = {stage: max(runs.values()) for stage, runs in self._reruns.items()}
        counts.update(self._checkpointed)
        return counts

    def resolve(self) -> None:
        """Adds the step's recorded spans to the times (one synchronisation per CUDA device),
        and takes the recomputed micro-batches the Stage modules counted this step."""
        self._checkpointed.update({index: len(stage.checkpointed) for index, stage in self._stages.items()})
        for device in set(self._devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        for stage, forward, start, end in self._spans:
            (self.forward_s if forward else self.backward_s)[stage] += _seconds(start, end)
        self._spans.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._leaves.clear()

    def _state(self) -> threading.local:
        if not hasattr(self._local, "open"):
            self._local.open = {}  # stage -> (start time, input grad_fn)
            self._local.recompute = {}  # (stage, layer) -> (start time, input grad_fn) of a rerun
            self._local.modes = []
        return self._local

    def _push(self, stage: int) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            mode = _AllocationProbe(self.ledger, stage)
            mode.__enter__()
            self._state().modes.append(mode)

        return pre_hook

    def _pop(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        modes = self._state().modes
        if modes:
            modes.pop().__exit__(None, None, None)

    def _rerun(self, stage: int, position: int) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if is_recomputing():
                self._reruns[stage][position] += 1
                if stage not in self._covered:
                    first = args[0] if args else None
                    grad_fn = first.grad_fn if isinstance(first, Tensor) else None
                    self._state().recompute[stage, position] = (_mark(_device_of(args)), grad_fn)

        return pre_hook

    def _reran(self, stage: int, position: int) -> Callable[..., None]:
        """A layer's rerun, timed with the nodes of the graph it rebuilt, for a stage no Stage
        module covers: layer by layer, so a per-layer mode's reruns are all found."""

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not is_recomputing() or stage in self._covered:
                return
            entry = self._state().recompute.pop((stage, position), None)
            if entry is not None and isinstance(output, Tensor):
                start, stop = entry
                self._spans.append((stage, False, start, _mark(output.device)))
                self._time_graph([output.grad_fn], stop, stage, output.device)

        return hook

    # -- timing at the stage module's boundary (pipeckpt's engines) ------------------------------
    # Every micro-batch of a stage that trains (and every recomputed one) is one autograd node
    # (``_Recompute``, one per segment under a per-layer mode) whose backward reruns and
    # backpropagates the stage: the walk from the stage's output to its input finds those few
    # nodes, and their run time is the stage's backward, recompute included, in every mode.

    def _enter_stage(self, stage: int) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            self._covered.add(stage)
            first = args[0] if args else None
            grad_fn = first.grad_fn if isinstance(first, Tensor) else None
            self._state().open[stage] = (_mark(_device_of(args)), grad_fn)

        return pre_hook

    def _leave_stage(self, stage: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            entry = self._state().open.pop(stage, None)
            if entry is None:
                return
            start, stop = entry
            # A tensor or a tuple of them is the common case; torch's pytree walk costs more.
            flat = output if isinstance(output, tuple) else (output,)
            if not all(isinstance(t, Tensor) for t in flat):
                flat = tuple(tree_flatten(output)[0])
            leaves = [t for t in flat if isinstance(t, Tensor)]
            if not leaves:
                return
            device = leaves[0].device
            self._spans.append((stage, True, start, _mark(device)))
            self._time_graph([t.grad_fn for t in leaves], stop, stage, device)

        return hook

    # -- timing at the first and last layer (no stage modules: one stage, or other engines) -------

    def _enter(self, stage: int) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if stage in self._covered or is_recomputing():  # a rerun is timed layer by layer (_rerun)
                return
            first = args[0] if args else None
            grad_fn = first.grad_fn if isinstance(first, Tensor) else None
            self._state().open[stage] = (_mark(_device_of(args)), grad_fn)

        return pre_hook

    def _leave(self, stage: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if stage in self._covered or is_recomputing():
                return
            entry = self._state().open.pop(stage, None)
            if entry is None or not isinstance(output, Tensor):
                return
            start, stop = entry
            self._spans.append((stage, True, start, _mark(output.device)))
            self._time_graph([output.grad_fn], stop, stage, output.device)

        return hook

    def _time_graph(self, roots: list[Optional[Node]], stop: Optional[Node], stage: int, device: Any) -> None:
        """Times every node between ``roots`` and ``stop``: everything the stage's backward runs,
        parameter accumulators included. The set of visited nodes lives only for this walk."""
        seen: set[Node] = set()
        todo = list(roots)
        while todo:
            node = todo.pop()
            if node is None or node is stop or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an accumulator: its leaf
            if variable is not None:
                if id(variable) in self._leaves:
                    continue
                self._leaves.add(id(variable))
            self._time_node(node, stage, device)
            todo.extend(next_node for next_node, _ in node.next_functions)

    def _time_node(self, node: Node, stage: int, device: torch.device) -> None:
        started: list[Mark] = []

        def before(grad_outputs: Any) -> None:
            started.append(_mark(device))

        def after(grad_inputs: Any, grad_outputs: Any) -> None:
            if started:
                self._spans.append((stage, False, started.pop(), _mark(device)))

        self._handles.append(node.register_prehook(before))
        self._handles.append(node.register_hook(after))


def pipeline_layers(module: L.LightningModule) -> nn.Sequential:
    """The module's ``configure_pipeline()`` Sequential: the layers a probe hooks."""
    hook = getattr(module, "configure_pipeline", None)
    if not callable(hook):
        raise TypeError(
            f"StageReport needs {type(module).__name__}.configure_pipeline() to know the layers; "
            f"add it (return your nn.Sequential) or remove the StageReport callback"
        )
    return hook()
