"""A tensor a stage's layers hand out other than through their return value, refused at the first step.

A stage's layers reach the rest of the model through what they return: the stage's autograd Function
(:mod:`pipeckpt.stages.recompute`) keeps its graph inside, and the distributed engine sends only the
layers' outputs to the next stage. A tensor a layer keeps aside for code outside the layers (Hugging
Face's ``output_router_logits`` / ``output_hidden_states`` / ``output_attentions`` recorders, a forward
hook or a layer that stores an activation for an auxiliary loss) goes around both: its gradient is lost
when the stage recomputes (the forward ran without a graph), backward runs the stage's graph twice when
it keeps it, and under the distributed engine it never reaches the last stage's loss. Nothing checks for
that after the fact, so the first micro-batch with gradients of every stage runs its layers under a
:class:`~torch.overrides.TorchFunctionMode` that notes (weakly) every floating-point tensor made inside
them; when the call has returned, one still held by Python (a list, a dict, a closure's cell, an object)
and not by the call's output or the stage's own bookkeeping is refused, naming the layer. Later
micro-batches and steps pay nothing (``Stage._watching`` is off).

Under the ``compile`` setting, the checked micro-batch runs each layer's own eager forward
(:func:`~pipeckpt.checkpointing.compiling.uncompiled`), so the check sees the layer's ops, not the
compiler's first call (on an H200, torch 2.11's inductor left tensors of an activation's shape held by
dicts and tuples after it, which the check refused). A stage whose layers were compiled with SAC inside
(a ``selective`` stage's) goes unchecked: their eager form is another region, with its own handling of
BatchNorm's running statistics, and Dynamo tracing them under the recorder would guard on the layer it
names, compiling each layer afresh until its recompile limit left the rest eager for good.
"""

import functools
import gc
import types
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from pipeckpt._errors import config_error
from pipeckpt.checkpointing.compiling import selective_in_graph, uncompiled

__all__ = ["EscapeWatch", "checked"]

_Made = Tuple[str, "weakref.ReferenceType[Tensor]", bool]  # layer, tensor, made with gradients on


# What makes a copy without graph: a tensor it returns carries none, whatever it was made from.
_NO_GRAPH = frozenset(
    {Tensor.detach, torch.detach, Tensor.detach_, Tensor.numpy, Tensor.data.__get__}  # type: ignore[attr-defined]
)


class _Recorder(TorchFunctionMode):
    """Notes every floating-point tensor a torch function returns while a layer of the stage runs, and
    whether it carries a graph. Under ``no_grad`` (a stage that recomputes runs its forward so) none
    does, so it notes those that would: made from a tensor that needs a gradient (a parameter, an input
    that does) or from one that would, other than by a copy without graph (``detach()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: Optional[str] = None  # the layer running now; None: outside the layers
        self.made: List[_Made] = []
        self._would: Dict[int, weakref.ReferenceType[Tensor]] = {}  # id -> a tensor that would need one

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.layer is not None:
            grad = torch.is_grad_enabled()
            given = list(_tensors((args, kwargs)))
            ids = {id(a) for a in given}
            carries = grad or (func not in _NO_GRAPH and any(self._needs(a) for a in given))
            for t in _tensors(out):  # not a tensor handed in and back as it is (``x.to(x.dtype)``)
                if (t.is_floating_point() or t.is_complex()) and id(t) not in ids and carries:
                    self.made.append((self.layer, weakref.ref(t), grad))
                    if not grad:
                        self._would[id(t)] = weakref.ref(t)
        return out

    def _needs(self, t: Tensor) -> bool:
        if t.requires_grad:
            return True
        ref = self._would.get(id(t))
        return ref is not None and ref() is t


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in ``value``: itself, or inside its tuples, lists and dicts."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())


class EscapeWatch:
    """One stage's check of its first micro-batch with gradients: its layers run under a recorder,
    and :meth:`check` refuses a tensor made inside them that Python still holds afterwards.

    Args:
        index: the stage's index in the pipeline.
        layers: the stage's layers.
        names: the user's names of ``layers`` (e.g. ``model.layers.1``).
    """

    def __init__(self, index: int, layers: Sequence[nn.Module], names: Sequence[str]) -> None:
        self.index = index
        self.names = {id(layer): name for layer, name in zip(layers, names)}
        self.layers = list(layers)
        self.recorder = _Recorder()
        self.ours: List[Any] = []  # containers of the stage's own that hold tensors made inside
        self.kept: List[Any] = []  # the outputs of kept micro-batches, which the stage returns detached

    def name_of(self, layer: Any) -> str:
        return self.names.get(id(layer), f"{type(layer).__name__} of pipeline stage {self.index}")

    def own(self, held: Any) -> None:
        """``held`` (a kept micro-batch's ``(output, inputs)``: its graph) is the stage's own; its output,
        where the stage returns it (as a copy without graph), counts as what the stage returns."""
        self.ours.append(held)
        if isinstance(held, tuple) and len(held) == 2:
            self.kept.append(held[0])
        for item in held if isinstance(held, tuple) else ():
            if isinstance(item, tuple):
                self.ours.append(item)

    def layer(self, fn: Callable[..., Any], layer: Any) -> Callable[..., Any]:
        """``fn`` (a layer's own forward) noting what it makes as the layer's."""
        name, recorder = self.name_of(layer), self.recorder

        @functools.wraps(fn)
        def inside(*args: Any, **kwargs: Any) -> Any:
            was, recorder.layer = recorder.layer, name
            try:
                return fn(*args, **kwargs)
            finally:
                recorder.layer = was

        inside.__self__ = getattr(fn, "__self__", None)  # type: ignore[attr-defined]  # kv_caches reads it
        return inside

    def run(self, call: Callable[[], Any], *, hooked: bool) -> Any:
        """``call()`` (the stage's micro-batch) recorded, then checked; ``hooked``: the layers are
        called by the stage itself (a Sequential), so hooks on them mark where each one runs."""
        handles = []
        if hooked:
            for layer in self.layers:
                handles.append(layer.register_forward_pre_hook(self._enter(self.name_of(layer))))
                handles.append(layer.register_forward_hook(self._leave, always_call=True))
        try:
            with self.recorder:
                out = call()
        finally:
            for handle in handles:
                handle.remove()
        self.check(out)
        return out

    def _enter(self, name: str) -> Callable[..., None]:
        def enter(module: nn.Module, args: Any) -> None:
            self.recorder.layer = name

        return enter

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.recorder.layer = None

    def check(self, output: Any) -> None:
        """Refuses a tensor made inside the layers that Python holds other than through ``output``."""
        made, self.recorder.made = self.recorder.made, []
        self.recorder._would.clear()
        ours, self.ours = self.ours, []
        kept, self.kept = self.kept, []
        containers: List[Any] = []  # the output's own tuples, lists and dicts hold what it returns
        leaves = list(_leaves(output, containers))
        returned = {id(t) for t in leaves}
        views = {_view(t) for t in leaves}  # a kept micro-batch returns its output's detached view
        leaves += [t for t in _leaves(kept, containers) if _view(t) in views]
        returned.update(id(t) for t in leaves)
        layers: Dict[int, str] = {}
        tensors: List[Tensor] = []
        outputs: Set[int] = set()  # of those, the stage's outputs
        for layer, ref, grad in made:
            t = ref()
            if t is None or id(t) in layers or isinstance(t, nn.Parameter):
                continue
            if id(t) in returned:  # the stage's output: kept aside too, it is a re-stored output
                if t.requires_grad:
                    layers[id(t)] = layer
                    tensors.append(t)
                    outputs.add(id(t))
                continue
            # With gradients on, a tensor that needs none carries no graph; autograd's own saved
            # tensors are alive too, but no Python object holds them (gc finds no referrer).
            if (grad and not t.requires_grad) or _through_function(t):
                continue
            layers[id(t)] = layer
            tensors.append(t)
        del made
        if not tensors:
            return
        mine: Set[int] = {id(tensors), id(leaves), *(id(c) for c in ours), *(id(c) for c in containers)}
        found = _held(tensors, layers, mine)
        if found is not None:  # maybe garbage not yet collected (a cycle): look again without it
            gc.collect()
            found = _held(tensors, layers, mine)
        if found is not None:
            t, holder = found
            if id(t) in outputs:
                raise _restored(layers[id(t)], self.index, t, holder)
            raise _escaped(layers[id(t)], self.index, t, holder)


def _held(tensors: List[Tensor], layers: Dict[int, str], mine: Set[int]) -> Optional[Tuple[Tensor, Any]]:
    """One of ``tensors`` that an object not in ``mine`` (nor a frame) holds, and that object: the one
    a user keeps rather than a tuple holding it on the way, when both do."""
    found: List[Tuple[Tensor, Any]] = []
    for holder in gc.get_referrers(*tensors):
        if id(holder) in mine or isinstance(holder, types.FrameType) or _is_args(holder, tensors):
            continue
        if isinstance(holder, dict) and _is_module_state(holder):
            continue
        if isinstance(holder, Tensor):  # a wrapper (a DTensor) holds its local tensor: checked itself
            continue
        for item in gc.get_referents(holder):
            if id(item) in layers and any(item is t for t in tensors):
                found.append((item, holder))
    return min(found, key=lambda pair: type(pair[1]) is tuple, default=None)


def checked(stage: Any, call: Callable[..., Any], fn: Optional[Callable[..., Any]] = None) -> Any:
    """``call()``, a micro-batch of ``stage`` (a :class:`~pipeckpt.stages.stage.Stage`), or with ``fn``
    given ``call(fn)``, a call of one of its layers (``fn``: the layer's forward) in its first micro-batch,
    checked for tensors that leave the layers other than through the output. ``call`` runs the stage's
    own method again, which the check is off for while it runs: for good after a micro-batch, until the
    stage's next step after a layer's call (every layer call of the first micro-batch is checked)."""
    layers = list(stage.partition) if isinstance(stage.partition, nn.Sequential) else [stage.partition]
    names = stage.layer_names or [f"stage {stage.index}'s layer {k}" for k in range(len(layers))]
    watch = None if selective_in_graph(stage.partition) else EscapeWatch(stage.index, layers, names)
    stage._watched, stage._watching, stage.watch = True, False, watch
    try:
        if watch is None:  # SAC compiled into the layers: unchecked (module doc)
            return call() if fn is None else call(fn)
        with uncompiled():
            if fn is None:
                return watch.run(call, hooked=True)
            own = watch.layer(fn, _layer_of(fn))
            return watch.run(lambda: call(own), hooked=False)
    finally:
        stage.watch = None
        stage._watching = fn is not None


def _layer_of(fn: Callable[..., Any]) -> Any:
    """The module whose bound ``forward`` ``fn`` is, through wrappers (``functools.wraps``)."""
    while fn is not None and getattr(fn, "__self__", None) is None:
        fn = getattr(fn, "__wrapped__", None)  # type: ignore[assignment]
    return getattr(fn, "__self__", None)


def _view(t: Tensor) -> Tuple[int, int, Tuple[int, ...], Tuple[int, ...]]:
    """Where ``t``'s elements are: a tensor and its ``detach()`` agree (a kept segment's output
    that the stage does not return, e.g. ``:1``'s first layer's, matches nothing returned)."""
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))


def _through_function(t: Tensor) -> bool:
    """Whether ``t`` is an output of a checkpointed region's Function (a segment's, ``:k``, that the
    next segment or the offloader keeps): its gradient goes through the Function, as an output's."""
    return t.grad_fn is not None and type(t.grad_fn).__name__ == "_RecomputeBackward"


def _is_args(holder: Any, tensors: List[Tensor]) -> bool:
    """Whether ``holder`` is the argument tuple of this module's own ``gc.get_referrers`` call."""
    return (
        type(holder) is tuple and len(holder) == len(tensors) and all(a is b for a, b in zip(holder, tensors))
    )


def _is_module_state(holder: Dict[Any, Any]) -> bool:
    """A module's ``_buffers``: a tensor a layer registers as its state is no escape."""
    return any(
        isinstance(r, nn.Module) and r.__dict__.get("_buffers") is holder for r in gc.get_referrers(holder)
    )


def _leaves(value: Any, containers: List[Any]) -> Iterator[Tensor]:
    """The tensors of ``value``; the containers walked through are added to ``containers``."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Tensor):
            yield v
            continue
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(getattr(v, "tensors", None), tuple):  # a boundary's Flat
            stack.append(v.tensors)
        else:
            continue
        containers.append(v)


def _escaped(layer: str, index: int, t: Tensor, holder: Any) -> Exception:
    kind = type(holder).__name__
    return config_error(
        f"layer {layer!r} (pipeline stage {index}) hands out a tensor other than through its return "
        f"value: a {tuple(t.shape)} tensor it made is still held by a {kind} after it returned",
        "a stage's layers reach the rest of the model only through what they return; a tensor kept "
        "aside (Hugging Face's output_router_logits / output_hidden_states / output_attentions "
        "recorders, a forward hook or a layer that stores an activation for an auxiliary loss) goes "
        "around the stage's checkpoint: its gradient would be lost under checkpoint='always', backward "
        "would run the stage's graph twice under 'never', and under engine='distributed' it never "
        "reaches the last stage's loss",
        "return the tensor from the layer (e.g. add the auxiliary loss to what it returns), keep a "
        "detach()ed copy if it is only logged, or remove the hook that stores it (Hugging Face's own "
        "recorders are carried when the model is pipelined with pipeline_of: see docs/REAL_MODELS.md)",
    )


def _restored(layer: str, index: int, t: Tensor, holder: Any) -> Exception:
    kind = type(holder).__name__
    return config_error(
        f"layer {layer!r} (pipeline stage {index}) keeps aside the very tensor its pipeline stage returns: "
        f"the {tuple(t.shape)} output is also held by a {kind} after the layer returned (e.g. a forward "
        "hook inside the stage that appends the output to a list the loss reads)",
        "what a stage returns reaches the rest of the model only through the stage's checkpoint: the "
        "same tensor read from aside carries the stage's graph around it (backward runs it twice, or "
        "fails with 'Trying to backward through the graph a second time'), and under "
        "engine='distributed' it never reaches the last stage's loss",
        "read the value from what the model returns (for a pipeline_of model, a forward hook on the "
        "named layer itself sees its output after the stage, as Hugging Face's output_hidden_states "
        "does), keep a detach()ed copy if it is only logged, or return the auxiliary term from the layer",
    )
