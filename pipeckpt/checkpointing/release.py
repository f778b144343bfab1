"""A recompute's saved tensors, each let go when its backward node takes it, not after the node.

Autograd frees a node's saved tensors once the node has run, so an ``addmm``'s saved input outlives
its last use through the bias-gradient sum. torch's non-reentrant checkpoint hands each tensor over
at unpack; :class:`ReleasedAtUnpack` does the same through ``saved_tensors_hooks``, since torch has no
public switch to drop a saved tensor at unpack. It costs a Python call per saved tensor
(``benchmarks/RESULTS.md``, "Costs quoted in the design notes"), so only ``<mode>:k`` stages use it
(docs/DESIGN.md, checkpointing/release).
"""

from types import TracebackType
from typing import Any, List, Optional, Type

from torch.autograd.graph import saved_tensors_hooks

from pipeckpt._compat import saved_tensors_hooks_now

__all__ = ["ReleasedAtUnpack"]


_TWICE = (
    "pipeckpt: a tensor saved for backward during a layer-by-layer recompute was unpacked twice: a "
    "custom autograd Function in this stage reads ctx.saved_tensors twice. Read it once and keep the "
    "result, or use a checkpoint mode without ':k' for this stage."
)


def _take(slot: List[Any]) -> Any:
    """A slot is a one-item list, emptied by its unpack. A second unpack is an error, as under
    ``torch.utils.checkpoint``: autograd's own nodes unpack once, and a value kept for a second one
    would be held through the node again."""
    try:
        return slot.pop()
    except IndexError:
        raise RuntimeError(_TWICE) from None


class ReleasedAtUnpack:
    """Within ``with``, values saved for backward are held by slots that give them up at unpack.

    Hooks the user had active (``torch.autograd.graph.save_on_cpu``, say) still run: each saved
    tensor goes through their pack, and its slot through their unpack. :meth:`clear` drops what no
    node unpacked (a node that never ran, e.g. on a path with no gradient): a saved output refers to
    its own node, and that cycle would otherwise outlive the recompute."""

    def __init__(self) -> None:
        slots: List[List[Any]] = []
        self._slots = slots

        def pack(value: Any) -> List[Any]:
            slot = [value]
            slots.append(slot)
            return slot

        outer = saved_tensors_hooks_now()
        if outer is None:
            self._hooks = saved_tensors_hooks(pack, _take)
        else:
            their_pack, their_unpack = outer
            self._hooks = saved_tensors_hooks(
                lambda tensor: pack(their_pack(tensor)), lambda slot: their_unpack(_take(slot))
            )

    def __enter__(self) -> "ReleasedAtUnpack":
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        kind: Optional[Type[BaseException]],
        error: Optional[BaseException],
        trace: Optional[TracebackType],
    ) -> None:
        self._hooks.__exit__(kind, error, trace)

    def clear(self) -> None:
        for slot in self._slots:
            slot.clear()
        self._slots.clear()
