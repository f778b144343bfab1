"""Any pytree as flat tensors and a spec: what crosses a stage boundary, taken apart and rebuilt.

Why not torch's ``tree_flatten`` alone: every stage runs every micro-batch through an autograd
Function whose inputs and outputs must be flat tensors, so a boundary value is flattened and
rebuilt several times per stage and micro-batch, and torch's walk made that path cost several
percent of a dispatch-bound step (``benchmarks/RESULTS_pytree.md``). Built-in tuples, lists and
dicts are walked here; any other node torch's pytree knows (named tuples, ``ModelOutput``,
registered classes) is flattened by torch. Non-tensor leaves stay in the :data:`Spec`.
"""

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from pipeckpt._compat import register_pytree_node, tree_flatten, tree_is_leaf, tree_unflatten

__all__ = [
    "TENSOR",
    "Args",
    "Flat",
    "Kwargs",
    "Spec",
    "TensorOrTensors",
    "first_tensor",
    "flatten",
    "flatten_into",
    "is_tensor_or_tensors",
    "to_device",
    "unflatten",
    "unflatten_from",
    "value",
]

# What an autograd Function (and torchgpipe) takes and returns: a tensor or a tuple of them.
TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]
Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]

# A value's structure with its non-tensor leaves, as :func:`flatten` makes it: ``TENSOR``
# for a tensor leaf, else a tuple whose first item is the function that rebuilds the node.
Spec = Any
TENSOR: Spec = "tensor"
_Build = Callable[[Any, Iterator[Tensor]], Any]
_SCALARS = frozenset({int, float, bool, str, bytes, complex, type(None)})


def unflatten_from(spec: Spec, tensors: Iterator[Tensor]) -> Any:
    """The value of ``spec``, its tensor leaves taken from ``tensors`` as it goes."""
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
    children), so torch's walks (hooks of the stage report) see through it.

    Args:
        tensors: the value's tensor leaves, in :func:`flatten`'s order.
        spec: the value's :data:`Spec`.
    """

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


def flatten_into(x: Any, out: List[Tensor]) -> Spec:
    """The :data:`Spec` of ``x``, its tensor leaves appended to ``out``."""
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
            specs.append(flatten_into(v, out))
    return tuple(specs)


def flatten(tree: Any) -> Tuple[List[Tensor], Spec]:
    """The tensor leaves of ``tree`` in torch's pytree order, and the :data:`Spec` (structure
    and non-tensor leaves) that :func:`unflatten` rebuilds it from."""
    out: List[Tensor] = []
    return out, flatten_into(tree, out)


def unflatten(spec: Spec, tensors: Sequence[Tensor]) -> Any:
    """The value :func:`flatten` took apart, with ``tensors`` in the places of its tensor leaves
    (new containers; non-tensor leaves are the very objects flattened)."""
    return unflatten_from(spec, iter(tensors))


def is_tensor_or_tensors(x: Any) -> bool:
    """Whether ``x`` is what an autograd Function takes and returns as it is: a tensor or a
    non-empty tuple of tensors (the fast path, which needs no flattening)."""
    return isinstance(x, Tensor) or (
        type(x) is tuple and len(x) > 0 and all(isinstance(t, Tensor) for t in x)
    )


def first_tensor(tree: Any) -> Optional[Tensor]:
    """The first tensor leaf with at least one dimension, or None."""
    if isinstance(tree, Tensor):
        return tree if tree.dim() > 0 else None
    for leaf in flatten(tree)[0]:
        if leaf.dim() > 0:
            return leaf
    return None


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with its tensors on ``device``: the very object when they are all there already."""
    if isinstance(tree, Tensor):
        return tree.to(device, non_blocking=True)
    tensors, spec = flatten(tree)
    if all(t.device == device for t in tensors):
        return tree
    return unflatten(spec, [t.to(device, non_blocking=True) for t in tensors])
