"""One pipeline stage: a partition of the user's layers run under its checkpoint mode.

The engine calls :meth:`Stage.begin_step` before each pipelined forward and then feeds the stage
its micro-batches in order, so a call counter tells it which micro-batch runs (``except_last``
needs that). Every micro-batch of a stage that trains runs through one autograd Function
(:mod:`pipeckpt.stages.recompute`), checkpointed or not, so gradients are bitwise equal in
every mode; ``offload`` keeps the Function's input in host memory
(:mod:`pipeckpt.checkpointing.offload`).
"""

import contextlib
from typing import Any, Callable, ContextManager, Dict, FrozenSet, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from pipeckpt.boundaries.calls import Call
from pipeckpt.boundaries.pytrees import is_tensor_or_tensors, value
from pipeckpt.checkpointing.kv_caches import without_kv_caches
from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.checkpointing.offload import backward_microbatches
from pipeckpt.checkpointing.order import Op, kept, local_order
from pipeckpt.stages.caller import CallerState, StepCasts
from pipeckpt.stages.escapes import checked
from pipeckpt.stages.guards import side_effect_free
from pipeckpt.stages.recompute import Recomputable
from pipeckpt.stages.segments import Segment, cut, selective

__all__ = ["Stage", "mark_shared_parameters"]

_NOTHING = contextlib.nullcontext()


class Stage(Recomputable):
    """A partition of the user's layers, its device and its checkpoint mode.

    The engine calls :meth:`begin_step` before each pipelined forward; every
    engine feeds a stage its micro-batches in order, so a call counter tells
    the stage which micro-batch it runs (``except_last`` needs that).

    Args:
        partition: the stage's layers (an ``nn.Sequential`` under a per-layer mode).
        index: the stage's index in the pipeline.
        mode: its checkpoint mode.
        device: the device its layers run on.
        pin_memory: whether an offloading mode copies the kept inputs to pinned host memory.
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
        super().__init__(partition, index=index, mode=mode, device=device, pin_memory=pin_memory)
        self._num_microbatches = 1
        self._caller = CallerState()
        self._keep: FrozenSet[int] = frozenset()  # what except_last keeps this step (the op order's)
        self.checkpointed: List[int] = []  # the micro-batches of this step that dropped activations
        self._segment_list: Optional[List[Segment]] = None  # under a granularity (mode.every)
        self.shares_parameters = False  # with another stage (tied weights): see mark_shared_parameters
        # Set by an engine whose schedule runs each micro-batch's backward as its own autograd call
        # (the distributed engine's whole-backward schedules): autograd then adds each kept
        # micro-batch's gradients to ``.grad`` in micro-batch order itself, as the Function would.
        self.backward_per_microbatch = False
        # What begin_step finds from its arguments, kept while they stay the same (a training run
        # repeats them every step): (micro-batches, order, mode) -> (kept, recomputes per step); the
        # same order list (the schedule's, kept by the engine) compares at once, by identity.
        self._planned: Optional[Tuple[Tuple[Any, ...], FrozenSet[int], int]] = None
        # Whether this step's micro-batches go straight to the layers (see begin_step).
        self._plain = False
        self.layer_names: Tuple[str, ...] = ()  # the user's names of the layers; set by the engine
        # Whether the first micro-batch with gradients is to be / was checked (stages/escapes.py).
        self._watching, self._watched = True, False

    @property
    def next_microbatch(self) -> int:
        """The index of the micro-batch the next :meth:`forward` runs."""
        return self._microbatch

    def _kept(self, num_microbatches: int, order: Optional[Sequence[Op]]) -> FrozenSet[int]:
        return kept(order if order is not None else local_order(self.index, num_microbatches), self.index)

    def recomputes_per_step(self, num_microbatches: int, *, order: Optional[Sequence[Op]] = None) -> int:
        """Runs of ``_Recompute`` one step makes: one per recomputed micro-batch and segment
        (selective checkpointing runs torch's checkpoint instead: none). ``order``: see
        :meth:`begin_step`."""
        return self._recomputes(num_microbatches, self._kept(num_microbatches, order))

    def _recomputes(self, num_microbatches: int, keep: FrozenSet[int]) -> int:
        """:meth:`recomputes_per_step` with the kept micro-batches ``keep`` already found."""
        if self.mode.selective:
            return 0
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
        self._watching = self._watching and not self._watched
        key = (num_microbatches, order, self.mode)  # held, not by id: an id may be reused
        if self._planned is None or self._planned[0] != key:
            keep = self._kept(num_microbatches, order)
            self._planned = (key, keep, self._recomputes(num_microbatches, keep))
        _, self._keep, recomputes = self._planned
        self.checkpointed = []
        if step is not None:
            self._step = step
        elif recomputes or self._step.remaining:  # one with no recomputes to count is never changed
            self._step = StepCasts(recomputes)
        self._params = None  # found again at the first checkpointed micro-batch of the step
        # Nothing between a micro-batch and the layers this step: no checkpointing (nor the Function
        # that orders kept micro-batches' gradients), no caller state to apply on another thread, no
        # layer that needs a random-stream key (none attached, or all known not to draw). Such a
        # micro-batch skips forward's checks: a dispatch-bound stage pays for every Python call of
        # every micro-batch (benchmarks/bench_host_cost.py).
        self._plain = (
            not self.mode.checkpoints
            and (self.streams is None or not self.streams.seeding)
            and not caller.active
            and not self._keeps_order()
            and not self._watching
        )
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
        if self._watching and torch.is_grad_enabled():
            return checked(self, lambda: self.forward(input, side))
        i = self._microbatch
        own = self.__dict__  # the counters are plain attributes (Recomputable.__setattr__)
        own["_microbatch"] = i + 1
        if self._plain and not side:
            own["forward_calls"] += 1
            return self.partition(value(input))
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
            # unless another stage adds to the same parameter (tied weights); nor where each
            # micro-batch's backward is an autograd call of its own (see ``_keeps_order``).
            if recompute or (self._keeps_order() and self._trainable()):
                if side is None and is_tensor_or_tensors(input):
                    return self._checkpointed(input, not recompute)
                call = Call(self._chain, (input,), side or {})
                return self._checkpointed_call(call, self._trainable(), not recompute)
        input = value(input)  # the local engine may hand over a boundary value in flat form
        if side:
            self.forward_calls += 1
            return self._chain(input, **side)
        return self._run(input)

    def _keeps_order(self) -> bool:
        """Whether a kept micro-batch needs the Function to add its gradients to ``.grad`` in
        micro-batch order: not with one micro-batch and no other stage adding to the same
        parameters, nor when each micro-batch's backward is its own autograd call
        (``backward_per_microbatch``, unless a split backward defers the weights' gradients to
        the Function's weight pass)."""
        if self.shares_parameters:
            return True
        if self.backward_per_microbatch and self.weight_passes is None:
            return False
        return self._num_microbatches > 1

    def _segments(self) -> List[Segment]:
        """The partition cut into runs of ``mode.every`` layers (all of it when None)."""
        if self._segment_list is None:
            self._segment_list = cut(self, self.mode.every)
        return self._segment_list

    def _granular(self, input: Any, side: Optional[Dict[str, Any]]) -> Any:
        """One micro-batch checkpointed segment by segment: each segment keeps its own input
        (``_Recompute``) or, selective, its matmul outputs (torch's SAC), so backward holds one
        segment's recompute at a time."""
        x = input
        for segment in self._segments():
            segment._step = self._step
            segment.streams = self.streams  # a recompute restores the micro-batch's layer streams
            segment.watch = self.watch
            segment_side = segment.side_of(side)
            if self.mode.selective:
                run = selective(
                    segment.partition, segment.run, segment.run_counted, segment.recompute_guard, self.streams
                )
                call = Call(run, (x, segment_side), {})
                x = segment._checkpointed_call(call, segment._trainable(), True)
            elif segment_side is None and is_tensor_or_tensors(x):
                x = segment._checkpointed(x, False)
            else:
                call = Call(segment._chain, (x,), segment_side or {})
                x = segment._checkpointed_call(call, segment._trainable(), False)
        return x

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
        if self._watching and i == 0 and torch.is_grad_enabled():
            return checked(self, lambda own: self.call_layer(own, params, i, args, kwargs), fn)
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
                call = Call(selective(self.partition, fn, counted, guard, self.streams), args, kwargs)
                return self._checkpointed_call(call, params, True)
            if recompute or ((self._num_microbatches > 1 or self.shares_parameters) and params):
                return self._checkpointed_call(Call(fn, args, kwargs), params, not recompute)
        self.forward_calls += 1
        return fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"index={self.index}, mode={self.mode.name}, device={self.device}"


def stage_modules(stages: List[Stage]) -> List[nn.Sequential]:
    """The user's partitions (Sequentials of their layers), e.g. for torchgpipe's skip-layout inspection."""
    parts = [s.partition for s in stages]
    assert all(isinstance(p, nn.Sequential) for p in parts)
    return cast(List[nn.Sequential], parts)


def mark_shared_parameters(stages: Sequence[Stage]) -> None:
    """Marks the stages holding a parameter that another of ``stages`` also holds (tied weights):
    their micro-batches always add gradients in place, so that the summation order is the same
    under every mode even with one micro-batch (see ``Stage._forward``).

    Args:
        stages: the stages of one engine (on this process).
    """
    owners: Dict[int, List[Stage]] = {}
    for stage in stages:
        for p in {id(p): p for p in stage.partition.parameters()}.values():
            owners.setdefault(id(p), []).append(stage)
    for held in owners.values():
        if len(held) > 1:
            for stage in held:
                stage.shares_parameters = True
