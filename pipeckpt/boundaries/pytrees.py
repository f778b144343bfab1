"""What crosses a stage boundary: any pytree, cut into micro-batches and joined back.

Why a module of its own: torchgpipe (and torch.distributed.pipelining) pass only
tensors or tuples of tensors between stages, so a stage returning ``(hidden, None)``,
a dict or a Hugging Face ``ModelOutput`` broke the pipeline. Here a value is any
pytree torch's ``_pytree`` can flatten (tuples, lists, dicts, named tuples, registered
classes such as ``ModelOutput``); every other object is a leaf.

The rules, in one place:

- the batch size ``B`` is ``size(0)`` of the first tensor leaf (with a dimension) of
  the call's first positional argument;
- a tensor leaf with ``size(0) == B`` is split into micro-batches (``Tensor.chunk``);
  every other leaf (non-tensors, ``None``, 0-dim tensors, tensors without the batch
  dimension such as a ``(T, T)`` causal mask) goes to every micro-batch unchanged;
- a keyword tensor (a side input) must have the batch dimension: one with another
  ``size(0)`` is an error that names the keyword;
- joining back: a tensor leaf is concatenated along dimension 0, unless every
  micro-batch returned the very same object (an unsplit value passed through), which
  is returned once; a 0-dim tensor computed per micro-batch (a loss) cannot be joined
  exactly and is refused; other leaves are taken from the first micro-batch.

Why a walk of our own (:func:`flatten`) beside torch's pytree: every stage runs every
micro-batch through an autograd Function whose inputs and outputs must be flat tensors,
so a boundary is flattened and rebuilt a handful of times per stage and micro-batch. On
the dispatch-bound proxy (``benchmarks/bench_pytree.py``) torch's ``tree_flatten``
(about 9 us for ``((dict,), {})``) made the pytree path cost 6-8% over tensors. Built-in
tuples, lists and dicts are walked here directly; every other object is asked of torch
(``tree_is_leaf``) and, when torch's pytree knows it as a node (named tuples, ``OrderedDict``,
``ModelOutput``, registered classes), flattened by torch. Non-tensor leaves are kept in the
:data:`Spec`, so flattening yields tensors only and rebuilding consumes tensors only.
"""

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from pipeckpt._compat import TreeSpec, register_pytree_node, tree_flatten, tree_is_leaf, tree_unflatten
from pipeckpt._errors import config_error

__all__ = [
    "TENSOR",
    "Call",
    "Flat",
    "Layout",
    "Spec",
    "Structure",
    "batch_size",
    "first_tensor",
    "flat_output",
    "flatten",
    "gather",
    "scatter",
    "to_device",
    "unflatten",
    "value",
]

Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]

# A value's structure with its non-tensor leaves, as :func:`flatten` makes it: ``TENSOR``
# for a tensor leaf, else a tuple whose first item is the function that rebuilds the node.
Spec = Any
TENSOR: Spec = "tensor"
_Build = Callable[[Any, Iterator[Tensor]], Any]
_SCALARS = frozenset({int, float, bool, str, bytes, complex, type(None)})
_WHOLE: Spec = "whole"  # a Call's spec is of its whole (args, kwargs)


def _node(spec: Spec, tensors: Iterator[Tensor]) -> Any:
    return next(tensors) if spec is TENSOR else spec[0](spec, tensors)


def _const(spec: Spec, tensors: Iterator[Tensor]) -> Any:
    return spec[1]


# The builders loop over a node's children in one frame, tensors and constants inline (a
# comprehension or a call per child is most of the cost of rebuilding a small boundary value).


def _items(spec: Spec, tensors: Iterator[Tensor]) -> List[Any]:
    out = []
    for c in spec[1]:
        if c is TENSOR:
            out.append(next(tensors))
        elif c[0] is _const:
            out.append(c[1])
        else:
            out.append(c[0](c, tensors))
    return out


def _tuple(spec: Spec, tensors: Iterator[Tensor]) -> Any:
    return tuple(_items(spec, tensors))


_list = _items


def _dict(spec: Spec, tensors: Iterator[Tensor]) -> Any:
    out = {}
    for key, c in zip(spec[2], spec[1]):
        if c is TENSOR:
            out[key] = next(tensors)
        elif c[0] is _const:
            out[key] = c[1]
        else:
            out[key] = c[0](c, tensors)
    return out


def _torch_node(spec: Spec, tensors: Iterator[Tensor]) -> Any:
    leaves = list(spec[2])
    for slot in spec[3]:
        leaves[slot] = next(tensors)
    return tree_unflatten(leaves, spec[1])


class Flat:
    """A value between two stages of the local engine in the flat form the stage's autograd
    Function made of it: its tensors and its :data:`Spec`. The next stage's :class:`Call`
    takes both as they are instead of rebuilding the value and walking it again; the value
    itself is rebuilt only where a layer reads it. A torch pytree node (its tensors are its
    children), so torch's walks (hooks of the stage report) see through it."""

    __slots__ = ("spec", "tensors")

    def __init__(self, tensors: Sequence[Tensor], spec: Spec) -> None:
        self.tensors = tensors
        self.spec = spec

    def value(self) -> Any:
        return unflatten(self.spec, self.tensors)


register_pytree_node(
    Flat, lambda f: (list(f.tensors), f.spec), lambda tensors, spec: Flat(list(tensors), spec)
)


def value(x: Any) -> Any:
    """``x`` itself, or the value a :class:`Flat` holds."""
    return x.value() if type(x) is Flat else x


def _walk(x: Any, out: List[Tensor]) -> Spec:
    if isinstance(x, Tensor):
        out.append(x)
        return TENSOR
    kind = type(x)
    if kind is Flat:
        out.extend(x.tensors)
        return x.spec
    if kind is tuple:
        return (_tuple, _children(x, out))
    if kind is dict:
        return (_dict, _children(x.values(), out), tuple(x))
    if kind is list:
        return (_list, _children(x, out))
    if kind in _SCALARS or tree_is_leaf(x):
        return (_const, x)
    leaves, spec = tree_flatten(x)  # a node type only torch's pytree knows
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    out.extend(leaves[i] for i in slots)
    return (_torch_node, spec, [None if i in slots else leaf for i, leaf in enumerate(leaves)], slots)


def _children(values: Iterable[Any], out: List[Tensor]) -> Tuple[Spec, ...]:
    # One loop for a container's items, tensors and scalars taken inline: a walk is a Python
    # call per item, which on a small boundary is most of its cost.
    specs = []
    for v in values:
        if isinstance(v, Tensor):
            out.append(v)
            specs.append(TENSOR)
        elif type(v) in _SCALARS:
            specs.append((_const, v))
        else:
            specs.append(_walk(v, out))
    return tuple(specs)


def flatten(tree: Any) -> Tuple[List[Tensor], Spec]:
    """The tensor leaves of ``tree`` in torch's pytree order, and the :data:`Spec` (structure
    and non-tensor leaves) that :func:`unflatten` rebuilds it from."""
    out: List[Tensor] = []
    return out, _walk(tree, out)


def unflatten(spec: Spec, tensors: Sequence[Tensor]) -> Any:
    """The value :func:`flatten` took apart, with ``tensors`` in the places of its tensor leaves
    (new containers; non-tensor leaves are the very objects flattened)."""
    return _node(spec, iter(tensors))


def first_tensor(tree: Any) -> Optional[Tensor]:
    """The first tensor leaf with at least one dimension, or None."""
    if isinstance(tree, Tensor):
        return tree if tree.dim() > 0 else None
    for leaf in flatten(tree)[0]:
        if leaf.dim() > 0:
            return leaf
    return None


def _batch_of(tensors: Sequence[Tensor], *, call: str) -> int:
    for x in tensors:
        if x.dim() > 0:
            return x.size(0)
    raise config_error(
        f"{call} with no tensor in its first argument",
        "the pipeline cuts the batch along dimension 0 of the first argument's tensors",
        "pass the batch (a tensor, or a tuple/dict holding tensors) as the first argument",
    )


def batch_size(args: Args, *, call: str) -> int:
    """``B``: ``size(0)`` of the first tensor leaf of the first positional argument."""
    return _batch_of(flatten(args[0])[0] if args else [], call=call)


def _check_side_inputs(kwargs: Kwargs, batch: int, *, call: str) -> None:
    for key, value in kwargs.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.size(0) != batch:
            raise config_error(
                f"side input {key}= of {call} (size(0) {value.size(0)}, batch {batch})",
                "keyword tensors are cut into micro-batches like the first argument, so they need "
                "its batch size along dimension 0",
                f"pass {key} with one row per sample, or compute it inside the layer that uses it",
            )


def scatter(
    args: Args,
    kwargs: Kwargs,
    chunks: int,
    *,
    call: str,
    device: Optional[torch.device] = None,
    flat_first: bool = False,
) -> List[Tuple[Args, Kwargs]]:
    """The call's ``(args, kwargs)`` cut into at most ``chunks`` micro-batches, its tensors moved
    to ``device`` (when given) on the way; ``flat_first``: each piece's first argument as a
    :class:`Flat` (for the local engine's first stage)."""
    tensors, first_spec = flatten(args[0]) if args else ([], TENSOR)
    batch = _batch_of(tensors, call=call)
    _check_side_inputs(kwargs, batch, call=call)
    n = len(tensors)
    more = len(args) > 1
    rest_spec = _walk((args[1:], kwargs) if more else kwargs, tensors) if more or kwargs else None
    if device is not None:
        for t in tensors:
            if t.device != device:
                tensors = [t.to(device, non_blocking=True) for t in tensors]
                break
        else:
            device = None  # all there already
    if chunks == 1 and device is None and not flat_first:
        return [(args, kwargs)]
    chunks = min(chunks, max(1, batch))  # no more pieces than samples (torch.chunk takes an int64)
    size = -(-batch // chunks)  # torch.chunk's pieces: ceil-sized, so maybe fewer than chunks
    count = -(-batch // size) if batch else 1
    columns = [x.chunk(chunks) if x.dim() > 0 and x.size(0) == batch else (x,) * count for x in tensors]
    flat = flat_first and first_spec is not TENSOR
    out: List[Tuple[Args, Kwargs]] = []
    for piece in zip(*columns):
        head = Flat(piece[:n], first_spec) if flat else unflatten(first_spec, piece[:n])
        if rest_spec is None:
            out.append(((head,), {}))
        elif not more:
            out.append(((head,), unflatten(rest_spec, piece[n:])))
        else:
            more_args, more_kwargs = unflatten(rest_spec, piece[n:])
            out.append(((head, *more_args), more_kwargs))
    return out


def gather(outputs: Sequence[Any], *, call: str) -> Any:
    """The micro-batches' outputs joined back into one value of the same structure."""
    if len(outputs) == 1:
        return value(outputs[0])
    tensors0, spec = flatten(outputs[0])
    columns = zip(tensors0, *(flatten(o)[0] for o in outputs[1:]))
    joined = []
    for index, column in enumerate(columns):
        first = column[0]
        if all(x is first for x in column):
            joined.append(first)
        elif first.dim() == 0:
            raise config_error(
                f"output tensor {index} of {call} (a 0-dim tensor, e.g. a loss)",
                "it is computed once per micro-batch and has no batch dimension to join along",
                "return per-sample values (logits) from the pipelined call and compute the loss from "
                "the joined output",
            )
        else:
            joined.append(torch.cat(column))
    return unflatten(spec, joined)


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with its tensors on ``device``: the very object when they are all there already."""
    if isinstance(tree, Tensor):
        return tree.to(device, non_blocking=True)
    tensors, spec = flatten(tree)
    if all(t.device == device for t in tensors):
        return tree
    return unflatten(spec, [t.to(device, non_blocking=True) for t in tensors])


class Structure:
    """Where the tensors of a flattened output go back, from torch's pytree: its spec and its
    other leaves (the distributed engine sends and compares these between processes)."""

    __slots__ = ("leaves", "slots", "spec")

    def __init__(self, leaves: List[Any], spec: TreeSpec) -> None:
        self.spec = spec
        self.slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        self.leaves = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]

    def rebuild(self, tensors: Sequence[Tensor]) -> Any:
        leaves = list(self.leaves)
        for slot, t in zip(self.slots, tensors):
            leaves[slot] = t
        return tree_unflatten(leaves, self.spec)


class Layout:
    """Where the tensors of a flattened output go back, from :func:`flatten`."""

    __slots__ = ("spec",)

    def __init__(self, spec: Spec) -> None:
        self.spec = spec

    def rebuild(self, tensors: Sequence[Tensor]) -> Any:
        return unflatten(self.spec, tensors)


def flat_output(output: Any) -> Tuple[Any, Optional[Layout]]:
    """``output`` unchanged if it is a tensor or a tuple of tensors (what an autograd Function
    may return); else its tensor leaves and the :class:`Layout` that rebuilds it."""
    if isinstance(output, Tensor):
        return output, None
    if type(output) is tuple and output and all(isinstance(t, Tensor) for t in output):
        return output, None
    tensors, spec = flatten(output)
    return tuple(tensors), Layout(spec)


class Call:
    """One call ``fn(*args, **kwargs)`` as flat tensors in and flat tensors out, for an autograd
    Function (whose inputs and outputs must be tensors). Non-tensor leaves and both
    structures are kept here; the output's structure is recorded by each run.

    The common call, one value and maybe side inputs (``fn(x, **side)``), keeps the spec of
    ``x`` (a :class:`Flat`'s as it is) and of the keywords apart, so nothing wraps them in the
    ``(args, kwargs)`` tuple to be walked; an output with one tensor leaf comes out of
    :meth:`run` as that tensor (what the Function returns for a plain tensor stage)."""

    __slots__ = ("flat", "fn", "inputs", "keys", "out", "rest", "spec")

    def __init__(self, fn: Callable[..., Any], args: Args, kwargs: Kwargs) -> None:
        self.fn = fn
        self.out: Spec = None
        self.flat = False  # the first argument is a Flat: the output stays flat too
        self.keys: Tuple[str, ...] = ()  # keywords whose values are all tensors (side inputs)
        self.rest: Spec = None  # else the keywords' spec, or _WHOLE: spec is of (args, kwargs)
        if len(args) != 1:
            self.inputs, self.spec = flatten((args, kwargs))
            self.rest = _WHOLE
            return
        x = args[0]
        if type(x) is Flat:
            self.inputs, self.spec, self.flat = list(x.tensors), x.spec, True
        else:
            self.inputs, self.spec = flatten(x)
        if kwargs:
            values = kwargs.values()
            if all(isinstance(v, Tensor) for v in values):
                self.keys = tuple(kwargs)
                self.inputs.extend(values)
            else:
                self.rest = _walk(kwargs, self.inputs)

    def tensors(self) -> Tuple[Tensor, ...]:
        return tuple(self.inputs)

    def run(self, tensors: Sequence[Tensor]) -> Any:
        """The call's output tensors: one tensor, or a tuple of them."""
        spec, keys, rest = self.spec, self.keys, self.rest
        if spec is TENSOR and (keys or rest is None):  # a tensor and maybe tensor keywords
            x = tensors[0]
            out = self.fn(x, **dict(zip(keys, tensors[1:]))) if keys else self.fn(x)
        else:
            it = iter(tensors)
            if rest is _WHOLE:
                args, kwargs = spec[0](spec, it)
                out = self.fn(*args, **kwargs)
            else:
                x = next(it) if spec is TENSOR else spec[0](spec, it)
                if keys:
                    out = self.fn(x, **dict(zip(keys, it)))
                elif rest is not None:
                    out = self.fn(x, **_node(rest, it))
                else:
                    out = self.fn(x)
        if isinstance(out, Tensor):
            self.out = TENSOR
            return out
        flat, self.out = flatten(out)
        return flat[0] if len(flat) == 1 else tuple(flat)

    def output(self, tensors: Any) -> Any:
        """The call's output with ``tensors`` (what :meth:`run` returned, through the Function)
        in place of its tensors: a :class:`Flat` when the call's first argument was one, unless
        the output is a single tensor."""
        assert self.out is not None, "output() follows run()"
        if self.out is TENSOR:
            return tensors
        if isinstance(tensors, Tensor):
            tensors = (tensors,)
        return Flat(tensors, self.out) if self.flat else unflatten(self.out, tensors)
