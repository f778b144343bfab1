"""What a module pipeline's stage hands the next: the layer outputs a later stage reads, no others.

Every stage replays the model's ``forward`` (``.rooted``) and takes each earlier layer's output
where that layer is called. Sending every output so far would cost each stage a receive buffer per
earlier layer per micro-batch, and a gradient buffer per output it sends: at 70B on eight stages,
more than the layers themselves. Which outputs a stage reads is probed once with the parameters'
readers (:attr:`pipeckpt.boundaries.outside_uses.OutsideUses.reads`): for a decoder, the layer before
its first; for a decoder after an encoder, also the encoder's last; the router logits the model's
loss adds up, on the last stage. An output no later stage reads crosses as its shape and dtype
(:class:`Withheld`), and the receiver's replay takes a meta tensor of them, so that the model's own
code between the layers (``layer_outputs[0]``, a shape read) runs as before, and a read the probe did
not see fails loudly (:func:`unread_error`) instead of computing on made-up values.
"""

from dataclasses import dataclass
from typing import Any, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from pipeckpt._compat import tree_flatten, tree_map, tree_unflatten
from pipeckpt._errors import config_error

__all__ = ["Withheld", "standing_in", "stands_in", "unread_error", "withheld"]

Produced = List[Tuple[int, Any]]  # (layer index, the output of its call), in call order
Sent = FrozenSet[Tuple[int, int]]  # (layer index, tensor leaf of its output)


@dataclass(frozen=True)
class Withheld:
    """A tensor of a layer's output that no later stage reads: it crosses as its shape and dtype,
    a non-tensor leaf of the stage output's structure (``.boundaries``)."""

    shape: Tuple[int, ...]
    dtype: torch.dtype


def withheld(produced: Produced, sent: Optional[Sent], counts: Sequence[int]) -> Produced:
    """``produced`` with every tensor not in ``sent`` replaced by its :class:`Withheld` (None:
    everything is sent). An output with other leaves than the probe saw (``counts``) goes whole. A
    meta tensor to be sent was computed from a stand-in (an op on meta and real tensors that gives
    meta, as a Linear's does): the error names it, and the caller reports it (:func:`unread_error`)."""
    if sent is None:
        return produced
    out: Produced = []
    for index, value in produced:
        leaves, spec = tree_flatten(value)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (Tensor, Withheld))]
        if index >= len(counts) or len(tensors) != counts[index]:
            out.append((index, value))
            continue
        for n, i in enumerate(tensors):
            leaf = leaves[i]
            if (index, n) not in sent and isinstance(leaf, Tensor):
                leaves[i] = Withheld(tuple(leaf.shape), leaf.dtype)
            elif isinstance(leaf, Tensor) and leaf.is_meta:  # made from a stand-in: a read unseen
                raise RuntimeError(f"a tensor on device meta in the output of layer {index}, to be sent")
        out.append((index, tree_unflatten(leaves, spec)))
    return out


def standing_in(received: Any) -> Any:
    """``received`` with each :class:`Withheld` a meta tensor of its shape and dtype."""

    def one(leaf: Any) -> Any:
        if isinstance(leaf, Withheld):
            return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
        return leaf

    return tree_map(one, received)


def stands_in(received: Any) -> bool:
    """Whether ``received`` holds a meta tensor that :func:`standing_in` made."""
    return any(isinstance(t, Tensor) and t.is_meta for t in tree_flatten(received)[0])


def unread_error(model: str, stage: int, error: BaseException) -> Exception:
    """The error of a stage whose replay computed on a layer output no earlier stage sent it."""
    return config_error(
        f"the forward of {model} on pipeline stage {stage} computed with a layer output of an earlier "
        f"stage that the probe of its reads did not see ({type(error).__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''})",
        "a stage receives only the earlier layer outputs its computation reads (through autograd, or "
        "where no gradient follows), found once, on the first batch's forward",
        "make the model's forward read the same layer outputs on every batch (no read through numpy "
        "or Python values that the probe cannot follow), or run it with engine='local'",
    )
