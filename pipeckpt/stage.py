"""One pipeline stage: a partition of the user's layers run under its mode.

Why a checkpoint of its own (``_Recompute``) rather than ``torch.utils.checkpoint``:
on a dispatch-bound stage the non-reentrant checkpoint's Python hook per saved
tensor (pack in forward, pack again in the recompute, unpack in backward) and
its per-call frame cost more than the stage's own kernels (measured: see
``benchmarks/bench_dispatch.py``). A stage is a closed function of its input and
parameters, so one autograd Function per micro-batch does the same job: its
forward runs the partition without building a graph and keeps only the input;
its backward replays the RNG state and autocast of the forward, runs the
partition once more with a graph, and returns the gradients of the input *and
the parameters* (they are the Function's inputs). The parameter gradients thus
reach the same ``AccumulateGrad`` nodes, in the same micro-batch order, as in
an uncheckpointed run, so gradients stay bitwise equal to ``never``, also when
``.grad`` already holds a sum (gradient accumulation). torchgpipe's own
checkpoint differs on both counts (one global mode; a nested ``backward`` that
adds to ``.grad`` directly). One limit: a parameter used twice *within* one
stage sums its two uses before the micro-batches are summed, which can differ
from ``never`` in the last bit.

``offload`` keeps the stage input in (pinned) host memory until backward.

Autocast's cast cache: the local engine runs every stage on the caller's thread
inside the caller's autocast, so weights are cast once per forward for all
micro-batches. The recomputes run in backward, outside that autocast; a step's
recomputes on one thread share one cast per weight (:class:`_CastCacheHold`)
instead of casting afresh for each micro-batch.

A stage called from a thread other than the one that captured the
:class:`CallerState` re-enters the caller's autocast and dispatch modes
(``FlopCounterMode``, ``MemTracker``), which are thread-local; on the caller's
own thread there is nothing to apply and that costs nothing.
"""

import contextlib
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch import Tensor, nn

from pipeckpt._compat import (
    BatchNormBase,
    TorchDispatchMode,
    apply_function,
    dispatch_mode_stack,
    enable_recomputing,
    gpipe_flags,
    gradients,
    pop_dispatch_mode,
    push_dispatch_mode,
)
from pipeckpt.boundary import Call, Structure, flat_output, tensor_leaves
from pipeckpt.modes import CheckpointMode
from pipeckpt.side_inputs import Chain

__all__ = ["Stage", "CallerState", "StepCasts", "capture_caller_state", "side_effect_free"]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
_NOTHING = contextlib.nullcontext()

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]
# How a checkpointed call's flat tensors are its input: True one tensor, False a tuple of
# tensors (the fast paths), or a Call for any pytree input and side inputs.
Packing = Union[bool, Call]
Autocast = Tuple[Tuple[str, torch.dtype], ...]


def _autocast_now() -> Autocast:
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        return ()
    return tuple(
        (d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(d)
    )


@dataclass(frozen=True)
class CallerState:
    """Thread-local state of the thread that called the pipeline."""

    autocast: Autocast = ()
    dispatch_modes: Tuple[TorchDispatchMode, ...] = ()
    thread: Optional[int] = None  # threading.get_ident() of the caller; None: unknown

    def needs_applying(self) -> bool:
        """False on the caller's own thread, or when the caller had nothing active."""
        if not self.autocast and not self.dispatch_modes:
            return False
        return self.thread != threading.get_ident()

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
                for device_type, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                yield
        finally:
            for _ in pushed:
                pop_dispatch_mode()


def capture_caller_state() -> CallerState:
    return CallerState(
        autocast=_autocast_now(), dispatch_modes=tuple(dispatch_mode_stack()), thread=threading.get_ident()
    )


@dataclass
class StepCasts:
    """One step's recomputes, shared by the stages of one engine: how many are still
    to run, so the last one on a thread lets autocast's cast cache go."""

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


def release_cast_cache() -> None:
    """Lets go of a cast cache this thread still holds (a backward stopped midway)."""
    _cast_cache.release()


def _batch_norms(partition: nn.Module) -> List[nn.Module]:
    return [m for m in partition.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]


def _norm_buffers(norms: Sequence[nn.Module]) -> List[Dict[str, Tensor]]:
    return [{k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None} for m in norms]


def _restore_norm_buffers(norms: Sequence[nn.Module], kept: List[Dict[str, Tensor]]) -> None:
    with torch.no_grad():
        for m, buffers in zip(norms, kept):
            for k, b in buffers.items():
                getattr(m, k).copy_(b)


@contextmanager
def side_effect_free(partition: nn.Module, norms: Optional[Sequence[nn.Module]] = None) -> Iterator[None]:
    """A recompute must leave module state as the first forward left it:
    BatchNorm running statistics are restored, and torchgpipe's
    DeferredBatchNorm is told it is recomputing so it does not track twice."""
    norms = _batch_norms(partition) if norms is None else norms
    kept = _norm_buffers(norms) if norms else None
    try:
        with enable_recomputing():
            yield
    finally:
        if kept is not None:
            _restore_norm_buffers(norms, kept)


class _RngState:
    """The CPU and (for a CUDA stage) device RNG states at a checkpointed forward."""

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: Optional[torch.device]) -> None:
        # The default generator's own methods: torch.get_rng_state/set_rng_state only wrap them.
        self.cpu = torch.default_generator.get_state()
        self.device = device
        self.cuda = torch.cuda.get_rng_state(device) if device is not None else None

    def restore(self) -> None:
        torch.default_generator.set_state(self.cpu)
        if self.device is not None and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def _offload(x: Tensor, pin_memory: bool) -> Tensor:
    # Stream-ordered: the copy back in backward runs on the same stream (autograd runs a
    # Function's backward on its forward's stream), so no host synchronisation is needed.
    host = torch.empty(x.size(), dtype=x.dtype, layout=x.layout, pin_memory=pin_memory)
    host.copy_(x, non_blocking=pin_memory)
    return host


class _Recompute(torch.autograd.Function):
    """A stage's micro-batch that keeps only its input and reruns itself in backward.

    Written for the dispatch-bound case, where every Python operation per micro-batch
    shows (``benchmarks/bench_dispatch.py``): flags set by plain try/finally rather than
    generator context managers, BatchNorm bookkeeping only when the stage has
    BatchNorms, autocast re-entered only when the forward ran under it, and one
    ``gradients`` call for the input and the parameters together."""

    @staticmethod
    def forward(ctx: Any, stage: "Stage", packing: Packing, n: int, *args: Tensor) -> Any:
        inputs = args[:n]
        ctx.stage, ctx.packing, ctx.params = stage, packing, args[n:]
        ctx.rng = _RngState(stage._cuda)
        ctx.autocast = autocast = _autocast_now()
        if autocast:
            ctx.step = stage._step
        flags = gpipe_flags
        was = flags.is_checkpointing
        flags.is_checkpointing = True
        try:
            output = stage._run_packed(packing, inputs)
        finally:
            flags.is_checkpointing = was
        ctx.flat = False
        if stage.mode.offloads and stage._cuda is not None:
            ctx.offloaded = tuple(_offload(x, stage.pin_memory) for x in inputs)
            ctx.requires = tuple(x.requires_grad for x in inputs)
        else:
            ctx.offloaded = None
            ctx.save_for_backward(*inputs)
        if isinstance(output, Tensor):
            if not (output.is_floating_point() or output.is_complex()):
                ctx.mark_non_differentiable(output)
            return output
        if not isinstance(packing, Call):
            output, structure = flat_output(output)
            if structure is not None:  # e.g. (tensor, None) or a dict: the stage rebuilds it
                stage._structure, ctx.flat = structure, True
        ctx.mark_non_differentiable(*[o for o in output if not (o.is_floating_point() or o.is_complex())])
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        stage: Stage = ctx.stage
        if ctx.offloaded is not None:
            inputs = [
                h.to(stage.device, non_blocking=stage.pin_memory).requires_grad_(r)
                for h, r in zip(ctx.offloaded, ctx.requires)
            ]
            ctx.offloaded = None
        elif ctx.packing is True:  # one tensor: the common case, without the loops
            (x,) = ctx.saved_tensors
            inputs = [x.detach().requires_grad_(x.requires_grad)]
        else:
            inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        norms = stage._norms()
        # BatchNorm statistics are restored only after the gradient: restoring bumps their
        # version, which autograd checks for the saved running statistics.
        kept = _norm_buffers(norms) if norms else None
        flags = gpipe_flags
        was = flags.is_recomputing
        flags.is_recomputing = True
        try:
            now = _RngState(stage._cuda)
            ctx.rng.restore()
            try:
                with torch.enable_grad():
                    if ctx.autocast:
                        output = _autocast_rerun(ctx, stage, inputs)
                    else:
                        output = stage._run_packed(ctx.packing, inputs, again=True)
            finally:
                now.restore()
            outs: Tuple[Tensor, ...]
            gs: Tuple[Tensor, ...]
            if isinstance(output, Tensor):
                g = grads[0]
                outs, gs = ((output,), (g,)) if g is not None and output.requires_grad else ((), ())
            else:
                if ctx.flat:
                    output = tensor_leaves(output)
                pairs = [(o, g) for o, g in zip(output, grads) if g is not None and o.requires_grad]
                outs, gs = tuple(o for o, _ in pairs), tuple(g for _, g in pairs)
            if len(inputs) == 1:
                wrt = (inputs[0], *ctx.params) if inputs[0].requires_grad else ctx.params
            else:
                wrt = (*(x for x in inputs if x.requires_grad), *ctx.params)
            found: Sequence[Optional[Tensor]] = (
                gradients(outs, gs, wrt) if outs and wrt else (None,) * len(wrt)
            )
        finally:
            flags.is_recomputing = was
            if kept is not None:
                _restore_norm_buffers(norms, kept)
        if len(inputs) == 1:
            return (None, None, None, *found) if inputs[0].requires_grad else (None, None, None, None, *found)
        it = iter(found)
        input_grads = [next(it) if x.requires_grad else None for x in inputs]
        return (None, None, None, *input_grads, *it)


def _autocast_rerun(ctx: Any, stage: "Stage", inputs: Sequence[Tensor]) -> Any:
    _cast_cache.hold(ctx.step)
    with ExitStack() as stack:
        for device_type, dtype in ctx.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        output = stage._run_packed(ctx.packing, inputs, again=True)
    if ctx.step.one_done():
        _cast_cache.release()
    return output


# Stage attributes that never hold a Parameter, Module or buffer.
_PLAIN_ATTRIBUTES = frozenset({"forward_calls", "_microbatch", "_structure"})


class Stage(nn.Module):
    """A partition of the user's layers, its device and its checkpoint mode.

    The engine calls :meth:`begin_step` before each pipelined forward; every
    engine feeds a stage its micro-batches in order, so a call counter tells
    the stage which micro-batch it runs (``except_last`` needs that).
    """

    def __init__(
        self,
        partition: nn.Module,
        *,
        index: int,
        mode: CheckpointMode,
        device: torch.device,
        pin_memory: bool = True,
    ) -> None:
        super().__init__()
        self.partition = partition
        self.index = index
        self.mode = mode
        self.device = device
        self.pin_memory = pin_memory
        self.forward_calls = 0  # runs of the partition, recomputes included
        self._microbatch = 0
        self._num_microbatches = 1
        self._caller = CallerState()
        self._step = StepCasts()
        self._params: Optional[Tuple[nn.Parameter, ...]] = None
        self._all_params: Optional[Tuple[nn.Parameter, ...]] = None
        self._cuda = device if device.type == "cuda" else None
        self._norm_list: Optional[List[nn.Module]] = None
        self._structure: Optional[Structure] = None  # of the output _Recompute just flattened
        self.chain: Optional[Chain] = None  # routes side inputs to the layers; set by the engine

    def __setattr__(self, name: str, value: Any) -> None:
        # The counters change several times per micro-batch; nn.Module's __setattr__ checks
        # every value for a Parameter, Module or buffer first, which a dispatch-bound stage pays for.
        if name in _PLAIN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def recomputes_per_step(self, num_microbatches: int) -> int:
        return sum(self.mode.recomputes(i, num_microbatches) for i in range(num_microbatches))

    def begin_step(
        self, num_microbatches: int, caller: CallerState = CallerState(), *, step: Optional[StepCasts] = None
    ) -> None:
        """``step`` is shared by the stages of one engine (see :class:`StepCasts`); a stage
        alone counts its own recomputes."""
        self._microbatch = 0
        self._num_microbatches = num_microbatches
        self._caller = caller
        self._step = step if step is not None else StepCasts(self.recomputes_per_step(num_microbatches))
        self._params = None  # found again at the first checkpointed micro-batch of the step

    def forward(self, input: Any, side: Optional[Dict[str, Any]] = None) -> Any:
        """Runs the next micro-batch. ``input`` is any pytree; ``side`` holds this
        micro-batch's side inputs, each handed to the layers whose ``forward`` declares it."""
        i = self._microbatch
        self._microbatch += 1
        if self._caller.needs_applying():
            with self._caller.applied():
                return self._forward(i, input, side)
        return self._forward(i, input, side)

    def _forward(self, i: int, input: Any, side: Optional[Dict[str, Any]]) -> Any:
        if torch.is_grad_enabled() and self.mode.recomputes(i, self._num_microbatches):
            if side is None and _tensor_or_tensors(input):
                return self._checkpointed(input)
            return self._checkpointed_call(Call(self._chain, (input,), side or {}), self._trainable())
        if side:
            self.forward_calls += 1
            return self._chain(input, **side)
        return self._run(input)

    def _run(self, input: Any) -> Any:
        self.forward_calls += 1
        return self.partition(input)

    def _chain(self, input: Any, **side: Any) -> Any:
        if not side:
            return self.partition(input)
        assert self.chain is not None, "side inputs reach a stage whose engine gave it a Chain"
        return self.chain(input, side)

    def _run_packed(self, packing: Packing, inputs: Sequence[Tensor], *, again: bool = False) -> Any:
        """``again``: a recompute, which needs a Call's output tensors only, not its structure."""
        if packing is True:
            return self._run(inputs[0])
        if packing is False:
            return self._run(tuple(inputs))
        assert isinstance(packing, Call)
        self.forward_calls += 1
        return packing.run(inputs, again=again)

    def _norms(self) -> List[nn.Module]:
        if self._norm_list is None:
            self._norm_list = _batch_norms(self.partition)
        return self._norm_list

    def _trainable(self) -> Tuple[nn.Parameter, ...]:
        if self._params is None:
            if self._all_params is None:
                self._all_params = tuple(self.partition.parameters())
            # Which parameters train may change between steps (freezing), not within one.
            self._params = tuple(p for p in self._all_params if p.requires_grad)
        return self._params

    def _checkpointed(self, input: TensorOrTensors) -> TensorOrTensors:
        atomic = isinstance(input, Tensor)
        inputs = (input,) if atomic else tuple(input)
        params = self._trainable()
        output = apply_function(_Recompute, self, atomic, len(inputs), *inputs, *params)
        if self._structure is not None:
            structure, self._structure = self._structure, None
            return structure.rebuild((output,) if isinstance(output, Tensor) else output)
        return output

    def _checkpointed_call(self, call: Call, params: Sequence[nn.Parameter]) -> Any:
        inputs = call.tensors()
        outputs = apply_function(_Recompute, self, call, len(inputs), *inputs, *params)
        return call.output(outputs)

    def call_layer(
        self,
        fn: Callable[..., Any],
        params: Sequence[nn.Parameter],
        i: int,
        args: Any,
        kwargs: Dict[str, Any],
    ) -> Any:
        """One call of one of this stage's layers by a module's own ``forward`` (a module
        pipeline, ``pipeckpt.split``), as micro-batch ``i``: checkpointed alone under the mode."""
        if self._caller.needs_applying():
            with self._caller.applied():
                return self._call_layer(fn, params, i, args, kwargs)
        return self._call_layer(fn, params, i, args, kwargs)

    def _call_layer(
        self,
        fn: Callable[..., Any],
        params: Sequence[nn.Parameter],
        i: int,
        args: Any,
        kwargs: Dict[str, Any],
    ) -> Any:
        if torch.is_grad_enabled() and self.mode.recomputes(i, self._num_microbatches):
            return self._checkpointed_call(Call(fn, args, kwargs), params)
        self.forward_calls += 1
        return fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"index={self.index}, mode={self.mode.name}, device={self.device}"


def _tensor_or_tensors(x: Any) -> bool:
    return isinstance(x, Tensor) or (
        type(x) is tuple and len(x) > 0 and all(isinstance(t, Tensor) for t in x)
    )


def stage_modules(stages: List[Stage]) -> List[nn.Sequential]:
    """The user's partitions (Sequentials of their layers), e.g. for torchgpipe's skip-layout inspection."""
    parts = [s.partition for s in stages]
    assert all(isinstance(p, nn.Sequential) for p in parts)
    return cast(List[nn.Sequential], parts)
