"""One pipeline stage: a partition of the user's layers run under its mode.

Why a checkpoint of its own (``_Recompute``) rather than ``torch.utils.checkpoint``:
on a dispatch-bound stage the non-reentrant checkpoint's Python hook per saved
tensor (pack in forward, pack again in the recompute, unpack in backward) and
its per-call frame cost more than the stage's own kernels (measured: see
``benchmarks/bench_dispatch.py``). A stage is a closed function of its input and
parameters, so one autograd Function per micro-batch does the same job: its
forward runs the partition without building a graph and keeps only the input;
its backward replays the RNG state and autocast of the forward, runs the
partition once more with a graph, and backpropagates through it.

Gradients, one micro-batch at a time: every micro-batch of a stage with
parameters to train runs through that Function, checkpointed or not (``keep``
builds and keeps the graph inside it instead of recomputing), and its backward
adds the parameters' gradients straight into ``.grad`` (in place where one is
held) as it makes them. Returned through the graph instead, the gradients of all
micro-batches would wait for the last one in a sum autograd keeps beside
``.grad``: with ``.grad`` already holding gradients (accumulation), a whole extra
copy. Every mode runs the same Function per micro-batch, so the outer graph,
the order in which micro-batches' gradients arrive and so the sums are the same
in every mode: gradients stay bitwise equal to ``never``, with ``.grad`` empty
or full. A stage's output needs a gradient whenever the stage trains, through
an empty "phony" leaf the Function takes in place of the parameters. One limit:
a parameter used twice *within* one stage sums its two uses before they reach
``.grad``, which can differ from an unpipelined run in the last bit.

``offload`` keeps the stage input in (pinned) host memory until backward, copied out and
prefetched back on side streams (:mod:`pipeckpt.checkpointing.offload`).

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
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    FrozenSet,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
    cast,
)

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from pipeckpt._compat import (
    BatchNormBase,
    TorchDispatchMode,
    accumulate_gradients,
    apply_function,
    dispatch_mode_stack,
    gpipe_flags,
    pop_dispatch_mode,
    push_dispatch_mode,
)
from pipeckpt.boundaries.pytrees import Call, Layout, flat_output, value
from pipeckpt.boundaries.side_inputs import Chain
from pipeckpt.checkpointing.kv_caches import without_kv_caches
from pipeckpt.checkpointing.layer_rng import LayerStreams
from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.checkpointing.offload import Copies, Offloader, backward_microbatches, copies_for
from pipeckpt.checkpointing.order import Op, kept, local_order
from pipeckpt.checkpointing.release import ReleasedAtUnpack
from pipeckpt.checkpointing.selective import run_selective

__all__ = [
    "Stage",
    "CallerState",
    "StepCasts",
    "capture_caller_state",
    "mark_shared_parameters",
    "side_effect_free",
]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
_NOTHING = contextlib.nullcontext()

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]
# How a checkpointed call's flat tensors are its input: True one tensor, False a tuple of
# tensors (the fast paths), or a Call for any pytree input and side inputs.
Packing = Union[bool, Call]
Autocast = Tuple[Tuple[str, torch.dtype], ...]
# The outputs' gradient edges and the gradients arriving for them.
_Roots = Tuple[List[GradientEdge], List[Tensor]]


def _autocast_now() -> Autocast:
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


class _Recomputing:
    """torchgpipe's ``is_recomputing`` flag for a ``with`` block. A class rather than torchgpipe's
    generator context manager: a dispatch-bound stage enters it once per recomputed micro-batch."""

    __slots__ = ("was",)

    def __enter__(self) -> None:
        self.was = gpipe_flags.is_recomputing
        gpipe_flags.is_recomputing = True

    def __exit__(self, *_: Any) -> None:
        gpipe_flags.is_recomputing = self.was


@contextmanager
def side_effect_free(partition: nn.Module, norms: Optional[Sequence[nn.Module]] = None) -> Iterator[None]:
    """A recompute must leave module state as the first forward left it:
    BatchNorm running statistics are restored, and torchgpipe's
    DeferredBatchNorm is told it is recomputing so it does not track twice."""
    norms = _batch_norms(partition) if norms is None else norms
    if not norms:
        with _Recomputing():
            yield
        return
    saved = [{k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None} for m in norms]
    try:
        with _Recomputing():
            yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for k, b in buffers.items():
                    getattr(m, k).copy_(b)


class _RngState:
    """The CPU and (for a CUDA stage) device RNG states at a checkpointed forward, and the
    micro-batch whose per-layer streams (``pipeckpt.checkpointing.layer_rng``) the stage was running."""

    __slots__ = ("cpu", "cuda", "device", "microbatch", "streams")

    def __init__(self, device: Optional[torch.device], streams: Optional[LayerStreams] = None) -> None:
        # The default generator's own methods: torch.get_rng_state/set_rng_state only wrap them.
        self.cpu = torch.default_generator.get_state()
        self.device = device
        self.cuda = torch.cuda.get_rng_state(device) if device is not None else None
        self.streams = streams
        self.microbatch = streams.current() if streams is not None else None

    def restore(self) -> None:
        torch.default_generator.set_state(self.cpu)
        if self.device is not None and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        if self.streams is not None:
            self.streams.set_current(self.microbatch)


class _Recompute(torch.autograd.Function):
    """A stage's micro-batch that keeps only its input and reruns itself in backward, or
    (``keep``) one that keeps its graph, built inside: either way its backward adds the
    parameters' gradients to ``.grad`` itself, one micro-batch at a time (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        stage: "Stage",
        packing: Packing,
        params: Tuple[nn.Parameter, ...],
        keep: bool,
        n: int,
        *args: Tensor,
    ) -> Any:
        inputs = args[:n]  # args[n:]: the stage's phony, when it has parameters to train
        # A Call holds the micro-batch's input tensors: a kept micro-batch's backward needs no
        # packing, and autograd keeps this ctx (not only its saved tensors) while anything holds
        # the graph, e.g. the loss during the whole backward, so it is not kept where not needed.
        ctx.stage, ctx.params, ctx.phonies = stage, params, len(args) - n
        ctx.packing = None if keep else packing
        ctx.kept = None
        if keep:
            inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)
            with torch.enable_grad():
                output = stage._run_packed(packing, inputs)
        else:
            ctx.rng = _RngState(stage._cuda, stage.streams)
            ctx.autocast = autocast = _autocast_now()
            if autocast:
                ctx.step = stage._step
            # torchgpipe's flag set directly: its setter is a generator context manager, whose
            # frame a dispatch-bound stage pays for twice per micro-batch.
            flags = gpipe_flags
            was = flags.is_checkpointing
            flags.is_checkpointing = True
            try:
                output = stage._run_packed(packing, inputs)
            finally:
                flags.is_checkpointing = was
        ctx.flat = False
        if not isinstance(packing, Call):
            output, structure = flat_output(output)
            if structure is not None:  # e.g. (tensor, None) or a dict: the stage rebuilds it
                stage._structure, ctx.flat = structure, True
        if keep:
            ctx.kept = (output, inputs)
            output = output.detach() if isinstance(output, Tensor) else tuple(o.detach() for o in output)
        elif stage.offloads:
            ctx.offloaded = stage._offloader().park(stage._running_microbatch(), inputs)
        else:
            ctx.offloaded = None
            ctx.save_for_backward(*inputs)
        if isinstance(output, Tensor):
            if not (output.is_floating_point() or output.is_complex()):
                ctx.mark_non_differentiable(output)
        else:
            ctx.mark_non_differentiable(*[o for o in output if not (o.is_floating_point() or o.is_complex())])
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        if ctx.kept is not None:
            output, inputs = ctx.kept
            ctx.kept = None
            roots = _Recompute._roots(output, grads)
            del output
            return _Recompute._gradients(ctx, roots, inputs)
        stage: Stage = ctx.stage
        if ctx.offloaded is not None:
            inputs = stage._offloader().fetch(ctx.offloaded)  # and prefetches the next ones
            ctx.offloaded = None
        else:
            inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        # BatchNorm statistics are restored only after the gradient: restoring bumps their
        # version, which autograd checks for the saved running statistics.
        norms = stage._norms()
        # Layer by layer (``:k``), each saved tensor goes at its last use (checkpointing.release).
        release = ReleasedAtUnpack() if stage.mode.every is not None else None
        with side_effect_free(stage.partition, norms) if norms else _Recomputing():
            now = _RngState(stage._cuda, stage.streams)
            ctx.rng.restore()
            try:
                if ctx.autocast:
                    _cast_cache.hold(ctx.step)
                    with ExitStack() as stack:
                        for device_type, dtype in ctx.autocast:
                            stack.enter_context(torch.autocast(device_type, dtype=dtype))
                        with torch.enable_grad(), release or _NOTHING:
                            output = stage._run_packed(ctx.packing, inputs)
                    if ctx.step.one_done():
                        _cast_cache.release()
                else:
                    with torch.enable_grad(), release or _NOTHING:
                        output = stage._run_packed(ctx.packing, inputs)
            finally:
                now.restore()
            # The recompute has run: the Call (and the input tensors it holds) goes now rather
            # than when autograd lets go of this node (with the graph, after the whole backward).
            ctx.packing = None
            if ctx.flat:
                output = flat_output(output)[0]
            roots = _Recompute._roots(output, grads)
            del output
            try:
                return _Recompute._gradients(ctx, roots, inputs)
            finally:
                if release is not None:
                    release.clear()

    @staticmethod
    def _roots(output: TensorOrTensors, grads: Sequence[Optional[Tensor]]) -> _Roots:
        """Where the backward through the recomputed (or kept) graph starts: the outputs' gradient
        edges, not the outputs, so that the caller can drop the outputs first and each goes as soon as
        the graph no longer needs it (unless a layer saved it), not after the whole backward."""
        if isinstance(output, Tensor):
            pairs = [(output, grads[0])] if grads[0] is not None and output.requires_grad else []
        else:
            pairs = [(o, g) for o, g in zip(output, grads) if g is not None and o.requires_grad]
        return [get_gradient_edge(o) for o, _ in pairs], [g for _, g in pairs]

    @staticmethod
    def _gradients(ctx: Any, roots: _Roots, inputs: Sequence[Tensor]) -> Tuple[Optional[Tensor], ...]:
        edges, grads = roots
        wrt = [x for x in inputs if x.requires_grad]
        if edges and (wrt or ctx.params):
            # The parameters' gradients go straight into ``.grad``, as this micro-batch's
            # backward makes each one: returned instead, autograd would sum them over the
            # step's micro-batches in a buffer of its own beside ``.grad`` (a whole extra
            # copy of the gradients when ``.grad`` already holds some: accumulation).
            accumulate_gradients(edges, grads, [*wrt, *ctx.params])
        del edges, grads, roots
        input_grads = [x.grad if x.requires_grad else None for x in inputs]
        # The inputs are leaves of this micro-batch's graph only: a gradient left on them would live as
        # long as anything holds the leaf (a module hook, a profiler: torch's MemTracker, whose module
        # tracking holds the layers' inputs, measured it beside the earlier stages' backward).
        for x in wrt:
            x.grad = None
        return (None, None, None, None, None, *input_grads, *([None] * ctx.phonies))


# Stage attributes that never hold a Parameter, Module or buffer.
_PLAIN_ATTRIBUTES = frozenset(
    {"forward_calls", "_microbatch", "_structure", "_num_microbatches", "_caller", "_keep", "checkpointed"}
    | {"_step", "_params", "streams", "chain"}
)


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
        self._structure: Optional[Layout] = None  # of the output _Recompute just flattened
        self._phony_leaf: Optional[Tensor] = None
        self.chain: Optional[Chain] = None  # routes side inputs to the layers; set by the engine
        self._keep: FrozenSet[int] = frozenset()  # what except_last keeps this step (the op order's)
        self.checkpointed: List[int] = []  # the micro-batches of this step that dropped activations
        self._segment_list: Optional[List[_Segment]] = None  # under a granularity (mode.every)
        self.streams: Optional[LayerStreams] = None  # per-layer random streams; set by the engine
        self.shares_parameters = False  # with another stage (tied weights): see mark_shared_parameters
        self.copies: Optional[Copies] = None  # offload's stream layer (None: the device's); tests inject one
        self._offload_state: Optional[Offloader] = None

    def __setattr__(self, name: str, value: Any) -> None:
        # The counters change several times per micro-batch; nn.Module's __setattr__ checks
        # every value for a Parameter, Module or buffer first, which a dispatch-bound stage pays for.
        if name in _PLAIN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def next_microbatch(self) -> int:
        """The index of the micro-batch the next :meth:`forward` runs."""
        return self._microbatch

    @property
    def offloads(self) -> bool:
        """Whether the inputs this stage keeps for its recomputes wait in host memory: an
        offloading mode on a CUDA stage (a CPU stage's inputs are in host memory already)."""
        return self.mode.offloads and self._cuda is not None

    def _offloader(self) -> Offloader:
        """The stage's offloader (a segment's: its parent's, so that one backward order spans
        the segments), made at first use."""
        root: Stage = self.__dict__.get("_parent", self)
        if root._offload_state is None:
            copies = root.copies if root.copies is not None else copies_for(root.device)
            root._offload_state = Offloader(copies, pin_memory=root.pin_memory)
        return root._offload_state

    def _running_microbatch(self) -> int:
        """The micro-batch whose forward runs now (a segment's: its parent's)."""
        return self.__dict__.get("_parent", self)._microbatch - 1

    def _kept(self, num_microbatches: int, order: Optional[Sequence[Op]]) -> FrozenSet[int]:
        return kept(order if order is not None else local_order(self.index, num_microbatches), self.index)

    def recomputes_per_step(self, num_microbatches: int, *, order: Optional[Sequence[Op]] = None) -> int:
        """Runs of ``_Recompute`` one step makes: one per recomputed micro-batch and segment
        (selective checkpointing runs torch's checkpoint instead: none). ``order``: see
        :meth:`begin_step`."""
        if self.mode.selective:
            return 0
        keep = self._kept(num_microbatches, order)
        n = sum(self.mode.recomputes(i, num_microbatches, keep=keep) for i in range(num_microbatches))
        return n * len(self._segments()) if self.mode.every is not None else n

    def begin_step(
        self,
        num_microbatches: int,
        caller: CallerState = CallerState(),
        *,
        step: Optional[StepCasts] = None,
        order: Optional[Sequence[Op]] = None,
    ) -> None:
        """``step`` is shared by the stages of one engine (see :class:`StepCasts`); a stage
        alone counts its own recomputes. ``order``: the ops the schedule runs on this stage's
        device this step (:mod:`pipeckpt.checkpointing.order`), from which ``except_last`` takes the
        micro-batches it keeps; default the local engine's order."""
        self._microbatch = 0
        self._num_microbatches = num_microbatches
        self._caller = caller
        self._keep = self._kept(num_microbatches, order)
        self.checkpointed = []
        self._step = (
            step if step is not None else StepCasts(self.recomputes_per_step(num_microbatches, order=order))
        )
        self._params = None  # found again at the first checkpointed micro-batch of the step
        for segment in self._segment_list or ():
            segment._params = None
        if self.offloads:
            ops = order if order is not None else local_order(self.index, num_microbatches)
            self._offloader().begin_step(backward_microbatches(ops, self.index))

    def take_microbatch(self) -> int:
        """The index of the micro-batch that runs now, counted as run: for an engine that calls the
        stage's layers one by one (:meth:`call_layer`) instead of :meth:`forward`."""
        i = self._microbatch
        self._microbatch += 1
        return i

    def forward(self, input: Any, side: Optional[Dict[str, Any]] = None) -> Any:
        """Runs the next micro-batch. ``input`` is any pytree; ``side`` holds this
        micro-batch's side inputs, each handed to the layers whose ``forward`` declares it."""
        i = self._microbatch
        self._microbatch += 1
        with self._layer_streams(i):
            if self._caller.needs_applying():
                with self._caller.applied():
                    return self._forward(i, input, side)
            return self._forward(i, input, side)

    def _layer_streams(self, i: int) -> ContextManager[None]:
        """Micro-batch ``i``'s per-layer random streams (``layer_rng``), when the engine set them."""
        return _NOTHING if self.streams is None else self.streams.microbatch(i)

    def _forward(self, i: int, input: Any, side: Optional[Dict[str, Any]]) -> Any:
        if torch.is_grad_enabled():
            recompute = self.mode.recomputes(i, self._num_microbatches, keep=self._keep)
            if recompute:
                self.checkpointed.append(i)
                if self.mode.every is not None or self.mode.selective:
                    return self._granular(input, side)
            # A kept micro-batch goes through the Function too, so that every micro-batch adds its
            # gradients to .grad in place, in one order, whatever the modes (bitwise equal to
            # ``never``, also under accumulation); with one micro-batch there is no sum to order,
            # unless another stage adds to the same parameter (tied weights).
            if recompute or ((self._num_microbatches > 1 or self.shares_parameters) and self._trainable()):
                if side is None and _tensor_or_tensors(input):
                    return self._checkpointed(input, not recompute)
                call = Call(self._chain, (input,), side or {})
                return self._checkpointed_call(call, self._trainable(), not recompute)
        input = value(input)  # the local engine may hand over a boundary value in flat form
        if side:
            self.forward_calls += 1
            return self._chain(input, **side)
        return self._run(input)

    def _run(self, input: Any) -> Any:
        self.forward_calls += 1
        return self.partition(input)

    def _segments(self) -> List["_Segment"]:
        """The partition cut into runs of ``mode.every`` layers (all of it when None)."""
        if self._segment_list is None:
            layers = list(self.partition) if isinstance(self.partition, nn.Sequential) else [self.partition]
            every = self.mode.every or len(layers)
            n = len(layers)
            spans = [range(a, min(a + every, n)) for a in range(0, n, every)]
            self._segment_list = [_Segment(self, span, layers) for span in spans]
        return self._segment_list

    def _granular(self, input: Any, side: Optional[Dict[str, Any]]) -> Any:
        """One micro-batch checkpointed segment by segment: each segment keeps its own input
        (``_Recompute``) or, selective, its matmul outputs (torch's SAC), so backward holds one
        segment's recompute at a time."""
        x = input
        for segment in self._segments():
            segment._step = self._step
            segment.streams = self.streams  # a recompute restores the micro-batch's layer streams
            segment_side = segment.side_of(side)
            if self.mode.selective:
                run = _selective(segment.run, segment.run_counted, segment.recompute_guard, self.streams)
                call = Call(run, (x, segment_side), {})
                x = segment._checkpointed_call(call, segment._trainable(), True)
            elif segment_side is None and _tensor_or_tensors(x):
                x = segment._checkpointed(x, False)
            else:
                call = Call(segment._chain, (x,), segment_side or {})
                x = segment._checkpointed_call(call, segment._trainable(), False)
        return x

    def _chain(self, input: Any, **side: Any) -> Any:
        if not side:
            return self.partition(input)
        assert self.chain is not None, "side inputs reach a stage whose engine gave it a Chain"
        return self.chain(input, side)

    def _run_packed(self, packing: Packing, inputs: Sequence[Tensor]) -> Any:
        if packing is True:
            return self._run(inputs[0])
        if packing is False:
            return self._run(tuple(inputs))
        assert isinstance(packing, Call)
        self.forward_calls += 1
        return packing.run(inputs)

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

    def _phony(self, params: Sequence[nn.Parameter]) -> Tuple[Tensor, ...]:
        """An empty leaf that needs a gradient, handed to ``_Recompute`` in place of the
        parameters (which it does not return gradients for), so that its output needs a
        gradient whenever the stage has parameters to train, as a plain run's would."""
        if not params:
            return ()
        if self._phony_leaf is None:
            self._phony_leaf = torch.empty(0, device=self.device, requires_grad=True)
        return (self._phony_leaf,)

    def _checkpointed(self, input: TensorOrTensors, keep: bool) -> TensorOrTensors:
        atomic = isinstance(input, Tensor)
        inputs = (input,) if atomic else tuple(input)
        params = self._trainable()
        output = apply_function(
            _Recompute, self, atomic, params, keep, len(inputs), *inputs, *self._phony(params)
        )
        if self._structure is not None:
            structure, self._structure = self._structure, None
            return structure.rebuild((output,) if isinstance(output, Tensor) else output)
        return output

    def _checkpointed_call(self, call: Call, params: Sequence[nn.Parameter], keep: bool) -> Any:
        inputs = call.tensors()
        params = tuple(params)
        outputs = apply_function(
            _Recompute, self, call, params, keep, len(inputs), *inputs, *self._phony(params)
        )
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
        pipeline, ``pipeline_of``), as micro-batch ``i``: checkpointed alone under the mode."""
        with self._layer_streams(i):
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
        if torch.is_grad_enabled():
            args, kwargs = without_kv_caches(fn, args, kwargs)  # in every mode: see checkpointing.kv_caches
            recompute = self.mode.recomputes(i, self._num_microbatches, keep=self._keep)
            if recompute and self.mode.selective:  # each layer call is its own checkpoint: mode.every is moot

                def counted(*a: Any, **k: Any) -> Any:
                    self.forward_calls += 1
                    return fn(*a, **k)

                guard = lambda: side_effect_free(self.partition, self._norms())  # noqa: E731
                call = Call(_selective(fn, counted, guard, self.streams), args, kwargs)
                return self._checkpointed_call(call, params, True)
            if recompute or ((self._num_microbatches > 1 or self.shares_parameters) and params):
                return self._checkpointed_call(Call(fn, args, kwargs), params, not recompute)
        self.forward_calls += 1
        return fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"index={self.index}, mode={self.mode.name}, device={self.device}"


def _selective(
    forward: Callable[..., Any],
    recompute: Callable[..., Any],
    guard: Callable[[], ContextManager[Any]],
    streams: Optional[LayerStreams],
) -> Callable[..., Any]:
    """A micro-batch's run under torch's selective checkpointing, made to be run by ``_Recompute``
    with ``keep``: SAC's graph is kept inside the Function, whose backward adds the parameters'
    gradients to ``.grad`` in place as every other mode does (summed in the same order, so
    bitwise equal to ``never``, also under accumulation). SAC calls the region once in forward
    (counted by ``_run_packed``) and again to recompute: ``recompute`` counts that run, under
    the per-layer random streams (``pipeckpt.checkpointing.layer_rng``) of the micro-batch it recomputes (SAC
    restores the generators' states, not which micro-batch's streams the layers draw from)."""
    runs = 0
    key = streams.current() if streams is not None else None

    def region(*args: Any, **kwargs: Any) -> Any:
        nonlocal runs
        runs += 1
        if runs == 1 or streams is None:
            return (forward if runs == 1 else recompute)(*args, **kwargs)
        now = streams.current()
        streams.set_current(key)
        try:
            return recompute(*args, **kwargs)
        finally:
            streams.set_current(now)

    return lambda *args, **kwargs: run_selective(region, args, kwargs, recompute_guard=guard)


class _Segment(Stage):
    """A run of layers of a stage, checkpointed as one (``mode.every``). A :class:`Stage` so that
    ``_Recompute`` finds in it all it reads from a stage; it is kept in a plain list, not as a
    submodule, so the parent's parameters and state-dict keys stay as they were. The first
    segment's runs count as the parent's runs, so ``forward_calls`` keeps its meaning."""

    def __init__(self, parent: Stage, layers: range, all_layers: Sequence[nn.Module]) -> None:
        super().__init__(
            nn.Sequential(*[all_layers[k] for k in layers]),
            index=parent.index,
            mode=parent.mode,
            device=parent.device,
            pin_memory=parent.pin_memory,
        )
        self.__dict__["_parent"] = parent  # not a submodule: the parent holds this segment
        self._range = layers

    def _count(self) -> None:
        if self._range.start == 0:
            self.__dict__["_parent"].forward_calls += 1

    def _run_packed(self, packing: Packing, inputs: Sequence[Tensor]) -> Any:
        self._count()
        return super()._run_packed(packing, inputs)

    def side_of(self, side: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """This segment's share of a micro-batch's side inputs, its layers' routes set to take them."""
        if not side:
            return None
        parent: Stage = self.__dict__["_parent"]
        assert parent.chain is not None, "side inputs reach a stage whose engine gave it a Chain"
        steps = parent.chain.steps[self._range.start : self._range.stop]
        self.chain = Chain([layer for layer, _ in steps], [route for _, route in steps])
        mine = self.chain.keys()
        return {k: v for k, v in side.items() if k in mine} or None

    def run(self, x: Any, side: Optional[Dict[str, Any]]) -> Any:
        """One forward of the segment's layers, uncounted (``_run_packed`` counts it)."""
        return self._chain(x, **side) if side else self.partition(x)

    def run_counted(self, x: Any, side: Optional[Dict[str, Any]]) -> Any:
        """One run (forward or recompute) under selective checkpointing."""
        self._count()
        self.forward_calls += 1
        return self._chain(x, **side) if side else self.partition(x)

    def recompute_guard(self) -> ContextManager[None]:
        return side_effect_free(self.partition, self._norms())


def _tensor_or_tensors(x: Any) -> bool:
    return isinstance(x, Tensor) or (
        type(x) is tuple and len(x) > 0 and all(isinstance(t, Tensor) for t in x)
    )


def stage_modules(stages: List[Stage]) -> List[nn.Sequential]:
    """The user's partitions (Sequentials of their layers), e.g. for torchgpipe's skip-layout inspection."""
    parts = [s.partition for s in stages]
    assert all(isinstance(p, nn.Sequential) for p in parts)
    return cast(List[nn.Sequential], parts)


def mark_shared_parameters(stages: Sequence[Stage]) -> None:
    """Marks the stages holding a parameter that another of ``stages`` also holds (tied weights):
    their micro-batches always add gradients in place, so that the summation order is the same
    under every mode even with one micro-batch (see ``Stage._forward``)."""
    owners: Dict[int, List[Stage]] = {}
    for stage in stages:
        for p in {id(p): p for p in stage.partition.parameters()}.values():
            owners.setdefault(id(p), []).append(stage)
    for held in owners.values():
        if len(held) > 1:
            for stage in held:
                stage.shares_parameters = True
