"""What crosses a process boundary: any pytree, sent as its tensors with its structure sent once.

Why not torch's own sends alone: ``torch.distributed.pipelining`` sends a tensor or a tuple of tensors,
and learns their shapes once per schedule (shape inference). So a single tensor goes as it is; any
other output is flattened (:class:`pipeckpt.boundaries.calls.Structure`): its tensors travel, and its
tree and non-tensor leaves, recorded during shape inference, ride with torch's shape metadata to the
next stage, which rebuilds the value. A micro-batch whose structure differs from the inferred one is
refused by the stage that made it (docs/DESIGN.md, engines/distributed/boundaries).
"""

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from pipeckpt._compat import tree_flatten
from pipeckpt._errors import config_error
from pipeckpt.boundaries.calls import Structure

__all__ = ["Boundaries", "announced", "sendable"]

Flat = Union[Tensor, Tuple[Tensor, ...]]


def _sendable(t: Tensor) -> Tensor:
    # The default memory format, which the receiver's buffer has; a copy keeps autograd's graph.
    return t if t.is_contiguous() else t.contiguous()


def sendable(flat: Flat) -> Flat:
    """``flat`` as tensors a process group sends: gloo (and NCCL) send only a dense, contiguous
    tensor, so a view with strides of its own (a transpose, an expanded bias), a channels_last
    tensor or a slice goes as a contiguous copy; what is contiguous already goes as it is."""
    if isinstance(flat, Tensor):
        return _sendable(flat)
    return tuple(_sendable(t) for t in flat)


def announced(flat: Flat) -> Flat:
    """A stage's ``flat`` output in shape inference, each floating tensor needing a gradient as a
    training micro-batch's all do (the stage's checkpoint Function makes them so), so that the
    next stage sends a gradient back for each; one without would fail the micro-batch's backward."""

    def one(t: Tensor) -> Tensor:
        floating = t.is_floating_point() or t.is_complex()
        return t.detach().requires_grad_() if floating and not t.requires_grad else t

    return one(flat) if isinstance(flat, Tensor) else tuple(one(t) for t in flat)


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose gradient leaves contiguous: a received tensor's gradient is sent back
    (an input read through a transpose would otherwise get a transposed gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


class _TensorLeaf:
    def __repr__(self) -> str:
        return "<tensor>"


def _shown(structure: Optional[Structure]) -> str:
    """The structure as the value it rebuilds, tensors shown as ``<tensor>``."""
    if structure is None:
        return "a tensor"
    return repr(structure.rebuild([_TensorLeaf()] * len(structure.slots)))  # type: ignore[list-item]


def _same(a: Optional[Structure], b: Optional[Structure]) -> bool:
    if a is None or b is None:
        return a is b
    if a.slots != b.slots or a.spec != b.spec:
        return False
    return all(_same_leaf(x, y) for x, y in zip(a.leaves, b.leaves))


def _same_leaf(x: Any, y: Any) -> bool:
    if type(x).__eq__ is object.__eq__:  # state made per call (a KV cache): of the same kind will do
        return type(x) is type(y)
    try:
        return bool(x == y)
    except Exception:  # a leaf whose == is not a bool (an array): compare by identity
        return x is y


class Boundaries:
    """The output structures of the stages of one schedule, by stage index (None: a tensor)."""

    def __init__(self) -> None:
        self._by_stage: Dict[int, Optional[Structure]] = {}

    def structure(self, index: int) -> Optional[Structure]:
        return self._by_stage.get(index)

    def put(self, index: int, structure: Optional[Structure]) -> None:
        """The structure of stage ``index``'s output, as received from the process that runs it."""
        self._by_stage[index] = structure

    def flatten(self, index: int, output: Any, *, inferring: bool, names: Sequence[str] = ()) -> Flat:
        """Stage ``index``'s ``output`` as tensors to send; while ``inferring``, its structure is
        recorded, afterwards it must match the recorded one."""
        if not inferring and isinstance(output, Tensor) and self._by_stage.get(index, False) is None:
            return output if output.is_contiguous() else output.contiguous()  # the usual case, in short
        if isinstance(output, Tensor):
            structure: Optional[Structure] = None
            flat: Flat = output
        else:
            leaves, spec = tree_flatten(output)
            structure = Structure(leaves, spec)
            flat = tuple(leaf for leaf in leaves if isinstance(leaf, Tensor))
            if not flat:
                raise config_error(
                    f"the output of pipeline stage {index} ({_shown(structure)})",
                    "the distributed engine sends a stage's tensors to the next process, and this output "
                    "holds none",
                    "return at least one tensor (the hidden state) from the last layer of every stage",
                )
        if inferring:
            self._by_stage[index] = structure
        elif index not in self._by_stage or not _same(self._by_stage[index], structure):
            self._changed(index, structure, names)
        return sendable(flat)

    def _changed(self, index: int, now: Optional[Structure], names: Sequence[str]) -> None:
        layers = f" (layers {names[0]} to {names[-1]})" if names else ""
        raise config_error(
            f"the output of pipeline stage {index}{layers} changed from {_shown(self._by_stage.get(index))} "
            f"to {_shown(now)}",
            "the distributed engine learns the structure of what a stage returns (its tree and "
            "non-tensor values) once per input shape, when it infers shapes, and then sends only tensors",
            "return the same structure for every micro-batch and step; pass a value that changes as a "
            "tensor (e.g. torch.tensor(n))",
        )

    def rebuild(self, index: int, tensors: Sequence[Tensor], *, inferring: bool = False) -> Any:
        """The value stage ``index`` returned, around the tensors that carry it (received from its
        process). Their gradients go back to it, and a process group sends only contiguous tensors:
        while ``inferring`` shapes, each goes through :class:`_ContiguousGradient`, since torch takes
        the gradients' strides for the sender's receive buffers from that pass; afterwards they are
        used as they are, as a hand-written pipeline uses them (``wiring.LiveStage.get_bwd_send_ops``
        makes their gradients contiguous before they go): a dispatch-bound stage pays for any
        operation on every tensor of every micro-batch. A stage that hands a received tensor on
        unchanged needs no copy either: torch detaches the last stage's outputs in place only after
        their backward, and marks its receive buffers as needing a gradient at every receive."""
        if inferring:
            return self._rebuild(
                index, [_ContiguousGradient.apply(t) if t.requires_grad else t for t in tensors]
            )
        return self._rebuild(index, tensors)

    def _rebuild(self, index: int, tensors: Sequence[Tensor]) -> Any:
        structure = self._by_stage.get(index)
        if structure is None:
            return tensors[0]
        return structure.rebuild(tensors)

    def rebuild_output(self, index: int, flat: Any) -> Any:
        """The last stage's ``flat`` output (what its module returned) as the user's value."""
        return self._rebuild(index, (flat,) if isinstance(flat, Tensor) else flat)
