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
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from pipeckpt._compat import TreeSpec, tree_flatten, tree_map, tree_unflatten
from pipeckpt._errors import config_error

__all__ = [
    "Call",
    "Structure",
    "batch_size",
    "first_tensor",
    "flat_output",
    "gather",
    "scatter",
    "to_device",
]

Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]


def first_tensor(tree: Any) -> Optional[Tensor]:
    """The first tensor leaf with at least one dimension, or None."""
    if isinstance(tree, Tensor):
        return tree if tree.dim() > 0 else None
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return leaf
    return None


def batch_size(args: Args, *, call: str) -> int:
    """``B``: ``size(0)`` of the first tensor leaf of the first positional argument."""
    x = first_tensor(args[0]) if args else None
    if x is None:
        raise config_error(
            f"{call} with no tensor in its first argument",
            "the pipeline cuts the batch along dimension 0 of the first argument's tensors",
            "pass the batch (a tensor, or a tuple/dict holding tensors) as the first argument",
        )
    return x.size(0)


def _check_side_inputs(kwargs: Kwargs, batch: int, *, call: str) -> None:
    for key, value in kwargs.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.size(0) != batch:
            raise config_error(
                f"side input {key}= of {call} (size(0) {value.size(0)}, batch {batch})",
                "keyword tensors are cut into micro-batches like the first argument, so they need "
                "its batch size along dimension 0",
                f"pass {key} with one row per sample, or compute it inside the layer that uses it",
            )


def scatter(args: Args, kwargs: Kwargs, chunks: int, *, call: str) -> List[Tuple[Args, Kwargs]]:
    """The call's ``(args, kwargs)`` cut into at most ``chunks`` micro-batches."""
    batch = batch_size(args, call=call)
    _check_side_inputs(kwargs, batch, call=call)
    if chunks == 1:
        return [(args, kwargs)]
    chunks = min(chunks, max(1, batch))  # no more pieces than samples (torch.chunk takes an int64)
    leaves, spec = tree_flatten((args, kwargs))
    count = len(torch.empty(batch, 0).chunk(chunks))  # chunk's own count: ceil-sized pieces
    columns = [
        leaf.chunk(chunks) if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.size(0) == batch else None
        for leaf in leaves
    ]
    out = []
    for i in range(count):
        piece = [leaf if col is None else col[i] for leaf, col in zip(leaves, columns)]
        out.append(tree_unflatten(piece, spec))
    return out


def gather(outputs: Sequence[Any], *, call: str) -> Any:
    """The micro-batches' outputs joined back into one value of the same structure."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [tree_flatten(o) for o in outputs]
    _leaves0, spec = flat[0]
    columns = list(zip(*(leaves for leaves, _ in flat)))
    joined = []
    for index, column in enumerate(columns):
        first = column[0]
        if not isinstance(first, Tensor) or all(x is first for x in column):
            joined.append(first)
        elif first.dim() == 0:
            raise config_error(
                f"output leaf {index} of {call} (a 0-dim tensor, e.g. a loss)",
                "it is computed once per micro-batch and has no batch dimension to join along",
                "return per-sample values (logits) from the pipelined call and compute the loss from "
                "the joined output",
            )
        else:
            joined.append(torch.cat(column))
    return tree_unflatten(joined, spec)


def to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, Tensor):
        return tree.to(device, non_blocking=True)
    return tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, Tensor) else x, tree)


class Structure:
    """Where the tensors of a flattened output go back: its spec and its other leaves."""

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


def flat_output(output: Any) -> Tuple[Any, Optional[Structure]]:
    """``output`` unchanged if it is a tensor or a tuple of tensors (what an autograd Function
    may return); else its tensor leaves and the :class:`Structure` that rebuilds it."""
    if isinstance(output, Tensor):
        return output, None
    if type(output) is tuple and output and all(isinstance(t, Tensor) for t in output):
        return output, None
    leaves, spec = tree_flatten(output)
    return tuple(leaf for leaf in leaves if isinstance(leaf, Tensor)), Structure(leaves, spec)


class Call:
    """One call ``fn(*args, **kwargs)`` as flat tensors in and flat tensors out, for an autograd
    Function (whose inputs and outputs must be tensors). Non-tensor leaves and both
    structures are kept here; the output's structure is recorded by each run."""

    __slots__ = ("fn", "leaves", "out", "slots", "spec")

    def __init__(self, fn: Callable[..., Any], args: Args, kwargs: Kwargs) -> None:
        self.fn = fn
        leaves, self.spec = tree_flatten((args, kwargs))
        self.slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        self.leaves = leaves
        self.out: Optional[Structure] = None

    def tensors(self) -> Tuple[Tensor, ...]:
        return tuple(self.leaves[i] for i in self.slots)

    def run(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The call's output tensors."""
        leaves = list(self.leaves)
        for slot, t in zip(self.slots, tensors):
            leaves[slot] = t
        args, kwargs = tree_unflatten(leaves, self.spec)
        out_leaves, spec = tree_flatten(self.fn(*args, **kwargs))
        self.out = Structure(out_leaves, spec)
        return tuple(leaf for leaf in out_leaves if isinstance(leaf, Tensor))

    def output(self, tensors: Sequence[Tensor]) -> Any:
        assert self.out is not None, "output() follows run()"
        return self.out.rebuild(tensors)
