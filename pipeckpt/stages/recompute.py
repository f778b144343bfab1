"""A stage's micro-batch as one autograd Function that reruns it in backward.

Why not ``torch.utils.checkpoint``: on a dispatch-bound stage its per-saved-tensor hooks and
per-call frames cost more than the stage's own kernels (``benchmarks/RESULTS_dispatch.md``).
A stage is a closed function of its input and parameters, so one Function per micro-batch keeps
only the input and, in backward, replays the RNG and autocast of the forward and reruns the
stage with a graph. Every mode runs every micro-batch through it and its backward adds the
parameters' gradients to ``.grad`` in place, so gradients stay bitwise equal to ``never``
(docs/ARCHITECTURE.md, "stages/recompute.py").
"""

import contextlib
from contextlib import ExitStack
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from pipeckpt._compat import accumulate_gradients, apply_function, gpipe_flags
from pipeckpt.boundaries.calls import Call, Layout, flat_output
from pipeckpt.boundaries.pytrees import TensorOrTensors
from pipeckpt.boundaries.side_inputs import Chain
from pipeckpt.checkpointing.compiling import uncompiled
from pipeckpt.checkpointing.layer_rng import LayerStreams
from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.checkpointing.offload import Copies, Offloader, copies_for
from pipeckpt.checkpointing.release import ReleasedAtUnpack
from pipeckpt.stages.caller import (
    StepCasts,
    autocast_now,
    caches_casts,
    entered,
    hold_cast_cache,
    release_cast_cache,
)
from pipeckpt.stages.escapes import EscapeWatch
from pipeckpt.stages.guards import Recomputing, RngState, batch_norms, side_effect_free
from pipeckpt.stages.weight_pass import WeightPass, input_pass

__all__ = ["Packing", "Recomputable"]

_NOTHING = contextlib.nullcontext()

# How a checkpointed call's flat tensors are its input: True one tensor, False a tuple of
# tensors (the fast paths), or a Call for any pytree input and side inputs.
Packing = Union[bool, Call]
# The outputs' gradient edges and the gradients arriving for them.
_Roots = Tuple[List[GradientEdge], List[Tensor]]


class _Recompute(torch.autograd.Function):
    """A stage's micro-batch that keeps only its input and reruns itself in backward, or
    (``keep``) one that keeps its graph, built inside: either way its backward adds the
    parameters' gradients to ``.grad`` itself, one micro-batch at a time (docs/ARCHITECTURE.md,
    "stages/recompute.py")."""

    @staticmethod
    def forward(
        ctx: Any,
        stage: "Recomputable",
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
        ctx.eager = stage.watch is not None  # the checked micro-batch ran uncompiled: so does its recompute
        if keep:
            inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)
            with torch.enable_grad():
                output = stage._run_packed(packing, inputs)
        else:
            ctx.rng = RngState(stage._cuda, stage.streams)
            ctx.autocast = autocast = autocast_now()
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
            if stage.watch is not None:  # the first step's check of escaping tensors: this graph is ours
                stage.watch.own(ctx.kept)
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
        stage: Recomputable = ctx.stage
        if ctx.offloaded is not None:
            inputs = stage._offloader().fetch(ctx.offloaded)  # and prefetches the next ones
            ctx.offloaded = None
        else:
            inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        # BatchNorm statistics are restored only after the gradient: restoring bumps their
        # version, which autograd checks for the saved running statistics.
        norms = stage._norms()
        # Layer by layer (``:k``), each saved tensor goes at its last use (checkpointing.release).
        # Not under a split backward: its weight pass reads saved tensors its input pass read.
        split = stage._weight_passes() is not None
        release = ReleasedAtUnpack() if stage.mode.every is not None and not split else None
        eager = uncompiled() if ctx.eager else _NOTHING
        with side_effect_free(stage.partition, norms) if norms else Recomputing(), eager:
            now = RngState(stage._cuda, stage.streams)
            ctx.rng.restore()
            try:
                if ctx.autocast:
                    if caches_casts(ctx.autocast):
                        hold_cast_cache(ctx.step)
                    with ExitStack() as stack:
                        entered(ctx.autocast, stack)
                        with torch.enable_grad(), release or _NOTHING:
                            output = stage._run_packed(ctx.packing, inputs)
                    if ctx.step.one_done():
                        release_cast_cache()
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
        passes = ctx.stage._weight_passes()
        if edges and passes is not None and ctx.params:
            # A split-backward schedule's input pass: the weights' gradients wait for its weight pass.
            weight_pass = input_pass(edges, grads, wrt, ctx.params)
            if weight_pass is not None:
                passes.append(weight_pass)
        elif edges and (wrt or ctx.params):
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


# Attributes of a stage or segment that never hold a Parameter, Module or buffer.
_PLAIN_ATTRIBUTES = frozenset(
    {"forward_calls", "_microbatch", "_structure", "_num_microbatches", "_caller", "_keep", "checkpointed"}
    | {"_step", "_params", "streams", "chain", "weight_passes", "_planned", "_plain", "watch", "_watching"}
)


class Recomputable(nn.Module):
    """Layers whose micro-batches run through the recompute Function: what it reads from a
    stage (or a segment of one), and the calls that hand it a micro-batch.

    Args:
        partition: the layers.
        index: the stage's index in the pipeline.
        mode: the stage's checkpoint mode.
        device: the device the layers run on.
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
        super().__init__()
        self.partition = partition
        self.index = index
        self.mode = mode
        self.device = device
        self.pin_memory = pin_memory
        self.forward_calls = 0  # runs of the partition, recomputes included
        self._microbatch = 0
        self._step = StepCasts()
        self._params: Optional[Tuple[nn.Parameter, ...]] = None
        self._all_params: Optional[Tuple[nn.Parameter, ...]] = None
        self._cuda = device if device.type == "cuda" else None
        self._norm_list: Optional[List[nn.Module]] = None
        self._structure: Optional[Layout] = None  # of the output _Recompute just flattened
        self._phony_leaf: Optional[Tensor] = None
        self.chain: Optional[Chain] = None  # routes side inputs to the layers; set by the engine
        self.streams: Optional[LayerStreams] = None  # per-layer random streams; set by the engine
        self.copies: Optional[Copies] = None  # offload's stream layer (None: the device's); tests inject one
        self._offload_state: Optional[Offloader] = None
        # Under a split-backward schedule (set by the engine): where each micro-batch's input pass
        # leaves its weight pass (stages/weight_pass.py); None: one whole backward.
        self.weight_passes: Optional[List[WeightPass]] = None
        # While the stage's first micro-batch with gradients runs: what checks that no tensor made
        # inside leaves other than through the output (stages/escapes.py).
        self.watch: Optional[EscapeWatch] = None

    def __setattr__(self, name: str, value: Any) -> None:
        # The counters change several times per micro-batch; nn.Module's __setattr__ checks
        # every value for a Parameter, Module or buffer first, which a dispatch-bound stage pays for.
        if name in _PLAIN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def offloads(self) -> bool:
        """Whether the inputs this stage keeps for its recomputes wait in host memory: an
        offloading mode on a CUDA stage (a CPU stage's inputs are in host memory already)."""
        return self.mode.offloads and self._cuda is not None

    def _offloader(self) -> Offloader:
        """The stage's offloader (a segment's: its parent's, so that one backward order spans
        the segments), made at first use."""
        root: Recomputable = self.__dict__.get("_parent", self)
        if root._offload_state is None:
            copies = root.copies if root.copies is not None else copies_for(root.device)
            root._offload_state = Offloader(copies, pin_memory=root.pin_memory)
        return root._offload_state

    def _weight_passes(self) -> Optional[List[WeightPass]]:
        """Where this micro-batch's weight pass goes (a segment's: its parent's), or None."""
        return self.__dict__.get("_parent", self).weight_passes

    def _running_microbatch(self) -> int:
        """The micro-batch whose forward runs now (a segment's: its parent's)."""
        return self.__dict__.get("_parent", self)._microbatch - 1

    def _run(self, input: Any) -> Any:
        self.forward_calls += 1
        return self.partition(input)

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
            self._norm_list = batch_norms(self.partition)
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
