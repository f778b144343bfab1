"""One call as flat tensors in and out, for an autograd Function, and the output's way back.

An autograd Function takes and returns tensors only; a stage's call takes any pytree and side
inputs and returns any pytree. :class:`Call` keeps the structures and non-tensor leaves while
its tensors go through the Function; :class:`Layout` (from :func:`flatten`) and
:class:`Structure` (from torch's pytree, sent between processes) rebuild a flattened output.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

from torch import Tensor

from pipeckpt._compat import TreeSpec, tree_unflatten
from pipeckpt.boundaries.pytrees import (
    TENSOR,
    Args,
    Flat,
    Kwargs,
    Spec,
    flatten,
    flatten_into,
    is_tensor_or_tensors,
    unflatten,
    unflatten_from,
)

__all__ = ["Call", "Layout", "Structure", "flat_output"]

_WHOLE: Spec = "whole"  # a Call's spec is of its whole (args, kwargs)


class Structure:
    """Where the tensors of a flattened output go back, from torch's pytree: its spec and its
    other leaves (the distributed engine sends and compares these between processes).

    Args:
        leaves: the output's leaves, from torch's ``tree_flatten``.
        spec: its tree spec.
    """

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
    """Where the tensors of a flattened output go back, from :func:`flatten`.

    Args:
        spec: the output's :data:`Spec`.
    """

    __slots__ = ("spec",)

    def __init__(self, spec: Spec) -> None:
        self.spec = spec

    def rebuild(self, tensors: Sequence[Tensor]) -> Any:
        return unflatten(self.spec, tensors)


def flat_output(output: Any) -> Tuple[Any, Optional[Layout]]:
    """``output`` unchanged if it is a tensor or a tuple of tensors (what an autograd Function
    may return); else its tensor leaves and the :class:`Layout` that rebuilds it."""
    if is_tensor_or_tensors(output):
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
    :meth:`run` as that tensor (what the Function returns for a plain tensor stage).

    Args:
        fn: the function called.
        args: its positional arguments, any pytrees.
        kwargs: its keyword arguments.
    """

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
                self.rest = flatten_into(kwargs, self.inputs)

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
                    out = self.fn(x, **unflatten_from(rest, it))
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
