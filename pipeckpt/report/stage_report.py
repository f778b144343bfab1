"""Per-stage time and activation memory, measured during real training steps.

A checkpoint mode is a trade between time and memory, so the report shows,
for every stage: its layers, parameters, peak activation memory, share of the
step time, and mode. It works for any strategy: under ``pipe`` the stages are
the plan's layer ranges, otherwise the whole ``configure_pipeline()``
Sequential is one stage.

How it measures, with hooks on the user's own layers (so any engine works) and,
under pipeckpt's engines, on each :class:`~pipeckpt.stages.stage.Stage` module:

* Time, at the stage's boundary (why: hooks on every autograd node cost about
  30 us each, 5% of a CPU step at ~1,350 nodes; the boundary needs a few per
  micro-batch). A pre-hook and a hook on the Stage module bracket each
  micro-batch's forward. Every micro-batch of a stage that trains or
  recomputes is one autograd node of pipeckpt's checkpoint Function (one per
  segment under a per-layer mode) whose backward reruns and backpropagates
  the stage, so the walk from the stage's output back to its input finds only
  those few nodes, and their summed run time is the stage's backward,
  recompute included, in every mode. (Timing from "gradient reaches the
  stage" to "gradient leaves it" would be wrong: the autograd engine
  interleaves the nodes of different stages and micro-batches.)
* Time, at the stage's first and last layer, for a stage no Stage module ran
  (no pipeline, or an engine that calls the layers one by one): the same
  forward bracket, and hooks on every autograd node between the stage's
  output and input; a recompute is timed layer by layer (each rerun and the
  nodes of the graph it rebuilds), so that per-layer modes are covered too.
* Recomputed micro-batches: a Stage module's own list of the micro-batches it
  checkpointed this step; without one, the runs of each layer while
  torchgpipe's ``is_recomputing()`` is set (pipeckpt's stages set it). Under a
  per-layer mode some layers never rerun (a parameter-free first layer whose
  input needs no gradient), so a stage's count is its most-rerun layer's.
* Marks: on CUDA a hook records an event on the current stream (no
  synchronisation: waiting for the device at every node would serialise host
  and device); the events are read once, at the end of the step, after a
  single synchronisation. On CPU a hook reads the host clock. The probe
  keeps no autograd node (a node kept alive keeps what it saved alive, which
  the memory figure would then count).
* Activation memory: an engine may run stages on threads of its own, and both
  ``saved_tensors_hooks`` and dispatch modes are thread-local, so the probe
  runs inside the layers: every layer's pre-hook enters a dispatch mode that
  its hook leaves (also when the layer raises, as a checkpoint recompute does
  once it has what it needs). Saved-tensor hooks are left alone, so
  checkpointing and offload behave as without the probe. The mode records
  each storage an op newly allocates on the stage's device (views and
  in-place ops allocate none; offloaded copies live on the host) and, through
  a weak reference, when it is freed. The peak of the live bytes allocated by
  a stage's forward and recomputes is its activation memory: what it keeps
  for backward plus its largest transient, excluding allocator caching and
  what backward itself allocates (gradients).

Measuring costs time, so only a few steps after a warm-up are measured: the
first with the memory probe, the others for time (or the first for both if
there is only one).
"""

import json
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.autograd.graph import Node
from torchgpipe import is_recomputing

from pipeckpt._compat import TorchDispatchMode, tree_flatten

if TYPE_CHECKING:
    from pipeckpt.stages.stage import Stage

__all__ = ["StageReport", "StageStats", "format_table", "save_chart", "human_bytes"]


@dataclass(frozen=True)
class StageStats:
    """What the report says about one stage. Times are per training step."""

    stage: int
    first_layer: int
    last_layer: int
    params: int
    peak_activation_bytes: int
    forward_s: float
    backward_s: float  # includes the recompute of checkpointed micro-batches
    recomputed: int  # micro-batches recomputed in backward, per step
    step_share: float  # (forward_s + backward_s) / step time
    mode: str


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


def _now(device: torch.device) -> float:
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


class _Probe:
    """Hooks on the user's layers (and on pipeckpt's stage modules, when given) that time and
    weigh each stage during one step."""

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
        """``stages``: pipeckpt's Stage modules, timed at their boundary when the engine calls them
        (a ``pipeline_of`` engine calls their layers one by one instead). ``count_layers=False``:
        the engine is known to call every one of ``stages`` (a step measured before said so), so
        their own lists of checkpointed micro-batches count the recomputes, with no hook on
        their layers; otherwise every layer counts its reruns."""
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


def _pipeline_layers(module: L.LightningModule) -> nn.Sequential:
    hook = getattr(module, "configure_pipeline", None)
    if not callable(hook):
        raise TypeError(
            f"StageReport needs {type(module).__name__}.configure_pipeline() to know the layers; "
            f"add it (return your nn.Sequential) or remove the StageReport callback"
        )
    return hook()


class StageReport(L.Callback):
    """Measures steps ``warmup_steps + 1`` to ``warmup_steps + steps`` of a fit
    (counted from the start of that fit, also after a resume), then prints the
    per-stage table (unless ``verbose=False``) and writes ``stage_report.png``
    and ``stage_report.json`` to ``dirpath`` (default: the trainer's
    ``default_root_dir``). The numbers stay in :attr:`stats`.
    """

    def __init__(
        self, *, warmup_steps: int = 2, steps: int = 3, dirpath: Optional[str] = None, verbose: bool = True
    ) -> None:
        if warmup_steps < 0 or steps < 1:
            raise ValueError(
                f"StageReport needs warmup_steps >= 0 and steps >= 1 "
                f"(warmup_steps: {warmup_steps}, steps: {steps})"
            )
        self.warmup_steps = warmup_steps
        self.steps = steps
        self.dirpath = dirpath
        self.verbose = verbose
        self.stats: list[StageStats] = []
        self._reset()

    def _reset(self) -> None:
        self._batches = 0
        self._probe: Optional[_Probe] = None
        self._started = 0.0
        # (step time, forward times, backward times, recomputed micro-batches) per measured step
        self._timed: list[tuple[float, dict[int, float], dict[int, float], dict[int, int]]] = []
        self._fallback: Optional[tuple[float, dict[int, float], dict[int, float], dict[int, int]]] = None
        self._peak: dict[int, int] = {}
        self._boundary: set[int] = set()  # stages whose Stage module the engine calls
        self._ranges: list[tuple[int, int]] = []
        self._modes: list[str] = []
        self._devices: list[torch.device] = []
        self._first, self._last = 0, 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layers = _pipeline_layers(pl_module)
        plan = getattr(trainer.strategy, "plan", None)
        if plan is not None:
            self._ranges = list(plan.ranges)
            self._modes = [m.name for m in plan.modes]
            self._devices = list(plan.devices)
        else:
            self._ranges = [(0, len(layers))]
            self._modes = ["none"]
            self._devices = [trainer.strategy.root_device]
        # A short run still gets measured: the warm-up shrinks to leave one step.
        steps_left = trainer.estimated_stepping_batches - trainer.global_step
        budget = (
            int(steps_left) * trainer.accumulate_grad_batches
            if steps_left != float("inf")
            else self.warmup_steps + self.steps
        )
        self._first = max(0, min(self.warmup_steps, budget - 1))
        self._last = self._first + self.steps - 1

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._first <= self._batches <= self._last:
            return
        memory = self._batches == self._first
        stages = list(getattr(trainer.strategy, "stages", None) or ())
        if not memory:
            # The memory step showed which Stage modules the engine calls: those count their own
            # recomputes, and their layers need no hook in the timed steps.
            stages = [stage for stage in stages if stage.index in self._boundary]
        self._probe = _Probe(
            _pipeline_layers(pl_module),
            self._ranges,
            self._devices,
            memory=memory,
            stages=stages,
            count_layers=memory,
        )
        self._started = _now(trainer.strategy.root_device)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        probe, self._probe = self._probe, None
        if probe is None:
            return
        step = _now(trainer.strategy.root_device) - self._started
        probe.remove()
        probe.resolve()
        if probe.memory:
            self._peak = dict(probe.ledger.peak)
            self._boundary = set(probe.covered)
        timing = (step, dict(probe.forward_s), dict(probe.backward_s), dict(probe.recomputed))
        if probe.memory:
            # The memory probe slows its step: its times are used only if no other step is measured.
            self._fallback = timing
        else:
            self._timed.append(timing)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._probe is not None:  # training stopped inside a measured step
            self._probe.remove()
            self._probe = None
        if not self._timed and self._fallback is not None:
            self._timed.append(self._fallback)
        if not self._timed:
            rank_zero_info("StageReport: no training step was measured (the fit ended before it).")
            return
        self.stats = _merged_over_ranks(trainer, self._summarise(_pipeline_layers(pl_module)))
        if trainer.is_global_zero:
            out = Path(self.dirpath or trainer.default_root_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "stage_report.json").write_text(json.dumps([asdict(s) for s in self.stats], indent=2))
            save_chart(self.stats, out / "stage_report.png")
            if self.verbose:
                print(format_table(self.stats), flush=True)

    def _summarise(self, layers: nn.Sequential) -> list[StageStats]:
        n = len(self._timed)
        step = sum(t[0] for t in self._timed) / n
        children = list(layers)
        stats = []
        for stage, ((first, stop), mode) in enumerate(zip(self._ranges, self._modes)):
            fwd = sum(t[1].get(stage, 0.0) for t in self._timed) / n
            bwd = sum(t[2].get(stage, 0.0) for t in self._timed) / n
            recomputed = round(sum(t[3].get(stage, 0) for t in self._timed) / n)
            params = sum(p.numel() for layer in children[first:stop] for p in layer.parameters())
            stats.append(
                StageStats(
                    stage=stage,
                    first_layer=first,
                    last_layer=stop - 1,
                    params=params,
                    peak_activation_bytes=self._peak.get(stage, 0),
                    forward_s=fwd,
                    backward_s=bwd,
                    recomputed=recomputed,
                    step_share=(fwd + bwd) / step if step > 0 else 0.0,
                    mode=mode,
                )
            )
        return stats


def _merged_over_ranks(trainer: L.Trainer, stats: list[StageStats]) -> list[StageStats]:
    """Under the distributed engine each process measures only the stages it holds: every
    stage's row comes from a process that holds it (a collective over all ranks)."""
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return stats
    held = [stage.index for stage in getattr(trainer.strategy, "stages", [])]
    pieces: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(pieces, (held, stats))
    merged = list(stats)
    for index in range(len(merged)):
        merged[index] = next((theirs[index] for owned, theirs in pieces if index in owned), merged[index])
    return merged


def human_bytes(nbytes: float) -> str:
    """``1536`` -> ``1.5 KiB``: activation sizes span bytes (an MLP) to gigabytes (a GPT)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def format_table(stats: list[StageStats]) -> str:
    """The report as an aligned text table, one line per stage."""
    header = (
        "stage",
        "layers",
        "params",
        "peak activations",
        "fwd ms",
        "bwd ms",
        "recomputed",
        "step share",
        "checkpoint",
    )
    rows = [
        (
            str(s.stage),
            f"{s.first_layer}-{s.last_layer}",
            f"{s.params:,}",
            human_bytes(s.peak_activation_bytes),
            f"{1e3 * s.forward_s:.1f}",
            f"{1e3 * s.backward_s:.1f}",
            f"{s.recomputed} mb",
            f"{100 * s.step_share:.0f}%",
            s.mode,
        )
        for s in stats
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = range(2, 8)  # right-aligned columns

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def save_chart(stats: list[StageStats], path: Path) -> None:
    """Two bar charts side by side: activation memory, and forward / backward time."""
    # A bare Figure renders to a file without pyplot, so the caller's matplotlib
    # backend stays as it was and no display is needed (cluster nodes have none).
    from matplotlib.figure import Figure

    labels = [f"{s.stage}\n{s.mode}" for s in stats]
    x = range(len(stats))
    fig = Figure(figsize=(4 + 1.2 * len(stats), 3.6))
    mem, tim = fig.subplots(1, 2)
    mem.bar(x, [s.peak_activation_bytes / 2**20 for s in stats], color="tab:blue")
    mem.set_title("peak activation memory")
    mem.set_ylabel("MiB")
    fwd = [1e3 * s.forward_s for s in stats]
    bwd = [1e3 * s.backward_s for s in stats]
    tim.bar(x, fwd, label="forward", color="tab:green")
    tim.bar(x, bwd, bottom=fwd, label="backward + recompute", color="tab:red")
    for i, s in enumerate(stats):
        tim.text(
            i, fwd[i] + bwd[i], f"{s.step_share:.0%} of step", ha="center", va="bottom", fontsize="x-small"
        )
    tim.set_title("time per step")
    tim.set_ylabel("ms")
    tim.set_ylim(top=1.35 * max([f + b for f, b in zip(fwd, bwd)] + [1e-3]))  # room for labels and legend
    tim.legend(fontsize="x-small", loc="upper center", ncols=2)
    for ax in (mem, tim):
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("stage / checkpoint mode")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
