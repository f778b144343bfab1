"""A call cut into micro-batches and their outputs joined back.

The batch size ``B`` is ``size(0)`` of the first tensor leaf (with a dimension) of the call's
first argument or, for a call with no tensor there (``model(**batch)``), of its first keyword
tensor, in call order; a tensor leaf with ``size(0) == B`` is cut with ``Tensor.chunk``, every
other leaf goes to every micro-batch unchanged; a keyword tensor must have the batch dimension.
Joining concatenates along dimension 0, and adds up 0-dim outputs (a loss) by the call's weights
(:mod:`pipeckpt.boundaries.scalars`). docs/ARCHITECTURE.md, "boundaries/microbatch.py", has every
rule. Why not torchgpipe's ``scatter``/``gather``: they take only tensors or tuples of tensors.
"""

from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from pipeckpt._errors import config_error
from pipeckpt.boundaries.pytrees import TENSOR, Args, Flat, Kwargs, flatten, flatten_into, unflatten, value
from pipeckpt.boundaries.scalars import LossWeights, column_of, warn_uncombined

__all__ = ["batch_size", "gather", "scatter"]


def _batch_of(args: Args, kwargs: Kwargs, *, call: str) -> int:
    for x in flatten(args[0])[0] if args else ():
        if x.dim() > 0:
            return x.size(0)
    for x in flatten(kwargs)[0] if kwargs else ():
        if x.dim() > 0:
            return x.size(0)
    raise config_error(
        f"{call} with no tensor in its first argument or its keywords",
        "the pipeline cuts the batch along dimension 0 of the first argument's tensors (or, with "
        "none there, of the first keyword tensor)",
        "pass the batch (a tensor, or a tuple/dict holding tensors) as the first argument or as "
        "keyword tensors",
    )


def batch_size(args: Args, *, call: str, kwargs: Optional[Kwargs] = None) -> int:
    """``B``: ``size(0)`` of the first tensor leaf of the first positional argument, or with no
    tensor there, of the first keyword tensor (in call order).

    Args:
        args: the call's positional arguments.
        call: the call's name, for the error when there is no tensor.
        kwargs: the call's keyword arguments.
    """
    return _batch_of(args, kwargs or {}, call=call)


def _check_side_inputs(kwargs: Kwargs, batch: int, *, call: str) -> None:
    for key, x in kwargs.items():
        if isinstance(x, Tensor) and x.dim() > 0 and x.size(0) != batch:
            raise config_error(
                f"side input {key}= of {call} (size(0) {x.size(0)}, batch {batch})",
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
    :class:`Flat` (for the local engine's first stage).

    Args:
        args: the call's positional arguments; the first one holds the batch.
        kwargs: the call's keyword arguments (side inputs).
        chunks: the most micro-batches to cut.
        call: the call's name, for errors.
        device: where the tensors go, when given.
        flat_first: whether each piece's first argument stays flat.
    """
    tensors, first_spec = flatten(args[0]) if args else ([], None)
    batch = _batch_of(args, kwargs, call=call)
    _check_side_inputs(kwargs, batch, call=call)
    n = len(tensors)
    more = len(args) > 1
    rest_spec = flatten_into((args[1:], kwargs) if more else kwargs, tensors) if more or kwargs else None
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
        if first_spec is None:  # keywords only: model(**batch)
            out.append(((), unflatten(rest_spec, piece)))
            continue
        head = Flat(piece[:n], first_spec) if flat else unflatten(first_spec, piece[:n])
        if rest_spec is None:
            out.append(((head,), {}))
        elif not more:
            out.append(((head,), unflatten(rest_spec, piece[n:])))
        else:
            more_args, more_kwargs = unflatten(rest_spec, piece[n:])
            out.append(((head, *more_args), more_kwargs))
    return out


def gather(outputs: Sequence[Any], *, call: str, weights: Optional[Callable[[], LossWeights]] = None) -> Any:
    """The micro-batches' outputs joined back into one value of the same structure: tensors
    concatenated along dimension 0, 0-dim tensors (a loss) added up by ``weights``.

    Args:
        outputs: each micro-batch's output, in order.
        call: the call's name, for errors.
        weights: makes the micro-batches' weights of a 0-dim output, asked only when there is one
            (:func:`~pipeckpt.boundaries.scalars.loss_weights`); without it a 0-dim output is
            refused.
    """
    if len(outputs) == 1:
        return value(outputs[0])
    tensors0, spec = flatten(outputs[0])
    columns = zip(tensors0, *(flatten(o)[0] for o in outputs[1:]))
    made: Optional[LossWeights] = None
    losses: Set[Optional[int]] = set()  # the columns combined as the call's loss
    joined = []
    for index, column in enumerate(columns):
        first = column[0]
        if all(x is first for x in column):
            joined.append(first)
        elif first.dim() == 0:
            if weights is None:
                raise config_error(
                    f"output tensor {index} of {call} (a 0-dim tensor, e.g. a loss)",
                    "it is computed once per micro-batch and has no batch dimension to join along",
                    "return per-sample values (logits) from the pipelined call and compute the loss "
                    "from the joined output",
                )
            if made is None:
                made = weights()
                # A MoE model's aux_loss (the routers' load-balancing loss) is a term of each
                # micro-batch's loss: combined by the loss's weights, the joined loss stays its sum.
                losses = {column_of(outputs), column_of(outputs, "aux_loss")}
            loss = index in losses
            if not (loss and made.exact):
                warn_uncombined(call, index, made, is_loss=loss)
            joined.append(made.combine(column, loss=loss))
        else:
            joined.append(torch.cat(column))
    return unflatten(spec, joined)
