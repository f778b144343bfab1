"""How a 0-dim output (a loss) of a pipelined call is combined over the call's micro-batches.

A loss is computed once per micro-batch and has no batch dimension to join along; the whole
batch's value is a weighted sum of the micro-batches' values, the weights read from the call:
a sum (HF's ``num_items_in_batch``) adds, a mean over label tokens (``labels=``) weighs each
micro-batch by its count of label tokens, any other scalar is taken as a mean over samples and
warned about. docs/USER_GUIDE.md, "A loss computed inside the model", states the rule. Why not
recompute the loss on the joined output: the loss is the model's own code, run as written.
"""

import warnings
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from torch import Tensor, nn

from pipeckpt._errors import PipeckptWarning
from pipeckpt.boundaries.pytrees import Args, Kwargs, first_tensor, flatten, value

__all__ = [
    "IGNORE_INDEX",
    "LossWeights",
    "column_of",
    "loss_of",
    "loss_weights",
    "shifts_labels",
    "step_weights",
    "warn_uncombined",
    "weigh",
]

IGNORE_INDEX = -100  # the label that no loss term counts (torch's cross_entropy default, HF's)


def shifts_labels(module: nn.Module) -> bool:
    """Whether ``module``'s loss predicts label ``t + 1`` from position ``t`` (a causal LM), so each
    row's first label is never counted: HF's rule for its own ``num_items_in_batch``, the model's
    ``loss_function`` being ``ForCausalLMLoss`` on a model that is not an encoder-decoder (which
    also covers GPT-2, whose ``loss_type`` is unset and whose loss is the causal one).

    Args:
        module: the pipelined module (a
            :class:`~pipeckpt.boundaries.pipeline_of.ModulePipeline` stands for its root).
    """
    root = getattr(module, "root", module)
    try:
        function = getattr(root, "loss_function", None)
    except Exception:  # a property of the user's model that needs more than the model
        return False
    config = getattr(root, "config", None)
    causal = getattr(function, "__name__", "") == "ForCausalLMLoss"
    return causal and not getattr(config, "is_encoder_decoder", False)


class LossWeights:
    """The weight of each micro-batch's loss in the whole batch's: ``kind`` names the rule
    (``"sum"``, ``"tokens"`` or ``"samples"``), ``weights`` holds one float per micro-batch, and
    ``samples`` each micro-batch's share of the samples (for any other 0-dim output).

    Args:
        kind: which rule made the weights.
        weights: one weight per micro-batch, in order.
        samples: ``b_i / B`` per micro-batch.
    """

    __slots__ = ("kind", "samples", "weights")

    def __init__(self, kind: str, weights: Sequence[float], samples: Sequence[float]) -> None:
        self.kind, self.weights, self.samples = kind, list(weights), list(samples)

    @property
    def exact(self) -> bool:
        """Whether the rule follows from the call (else the loss is assumed a mean over samples)."""
        return self.kind != "samples"

    def combine(self, values: Sequence[Tensor], *, loss: bool = True) -> Tensor:
        """The whole batch's value of ``values``, one 0-dim tensor per micro-batch: the call's loss
        by :attr:`weights`, any other 0-dim output (``loss=False``) by :attr:`samples`. A
        micro-batch with no label token (its mean is ``0 / 0``) adds zero and keeps its graph."""
        if loss and self.kind == "sum":
            total = values[0]
            for x in values[1:]:
                total = total + x
            return total
        weights = self.weights if loss else self.samples
        terms = [weigh(x, w) for x, w in zip(values, weights)]
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        return total


def weigh(value: Tensor, weight: float) -> Tensor:
    """``value * weight``; zero (keeping the graph) for weight 0, whose value may be ``0 / 0``."""
    return value * weight if weight else value.nan_to_num(0.0) * 0.0


def _samples(calls: Sequence[Tuple[Args, Kwargs]]) -> List[int]:
    sizes = []
    for args, kwargs in calls:
        x = first_tensor(args[0]) if args else None
        x = x if x is not None else first_tensor(kwargs)
        sizes.append(x.size(0) if x is not None else 1)
    return sizes


def _tokens(labels: Tensor, shift: bool) -> int:
    counted = labels[..., 1:] if shift else labels
    return int(counted.ne(IGNORE_INDEX).sum())


def loss_weights(calls: Sequence[Tuple[Args, Kwargs]], *, shift: bool) -> LossWeights:
    """The weights of the micro-batches' losses, from each micro-batch's call ``(args, kwargs)``.

    - a keyword ``num_items_in_batch`` (HF: the loss is a sum over tokens divided by that fixed
      number): every weight 1, the values add up (exact for any sum);
    - else a keyword tensor ``labels``: ``n_i / N``, ``n_i`` the count of micro-batch ``i``'s labels
      that are not -100 (``labels[..., 1:]`` when ``shift``: a causal LM never predicts the first
      label), ``N`` their sum: exact for a mean over the counted tokens (HF's mean-reduced losses);
    - else ``b_i / B``, micro-batch ``i``'s share of the samples: exact for a mean over samples.

    Args:
        calls: each micro-batch's call of the pipelined module.
        shift: whether the model's loss drops each row's first label (:func:`shifts_labels`).
    """
    sizes = _samples(calls)
    samples = [b / sum(sizes) for b in sizes]
    if any("num_items_in_batch" in kwargs for _, kwargs in calls):
        return LossWeights("sum", [1.0] * len(calls), samples)
    labels = [y for _, kwargs in calls if isinstance(y := kwargs.get("labels"), Tensor) and y.dim() > 0]
    if len(labels) == len(calls):
        counts = [_tokens(y, shift) for y in labels]
        total = sum(counts)
        if total:
            return LossWeights("tokens", [c / total for c in counts], samples)
    return LossWeights("samples", samples, samples)


def loss_of(output: Any, key: str = "loss") -> Optional[Tensor]:
    """The call's loss in ``output``: the output itself when it is a 0-dim tensor, else its
    ``key`` entry (a dict's, or a ``ModelOutput``'s) when that is a 0-dim tensor."""
    output = value(output)
    if isinstance(output, Mapping):
        output = output.get(key)
    elif key != "loss":
        return None
    return output if isinstance(output, Tensor) and output.dim() == 0 else None


def warn_uncombined(call: str, index: int, weights: LossWeights, *, is_loss: bool) -> None:
    """Warns that output tensor ``index`` of ``call`` was combined as a mean over samples."""
    why = (
        "the call passes neither labels= (a mean over label tokens) nor num_items_in_batch= (a sum)"
        if is_loss
        else "only the call's loss (its 'loss' entry) is combined by the call's labels"
    )
    warnings.warn(
        f"output tensor {index} of {call} is 0-dim (computed once per micro-batch); {why}, so it is "
        f"combined as a mean over samples (micro-batch weights {[round(w, 4) for w in weights.samples]}), "
        "which equals the whole batch's value only if it is one. HINT: return per-sample values from "
        "the pipelined call and reduce them in your step, or pass labels=",
        PipeckptWarning,
        stacklevel=4,
    )


def step_weights(calls: Sequence[Tuple[Args, Kwargs]], module: nn.Module) -> Optional[LossWeights]:
    """The weights of a step's loss returned once per micro-batch (the distributed engine), from
    the calls of the pipelined ``module``; None when the rule is the mean over samples.

    Args:
        calls: each micro-batch's call of the pipelined module.
        module: the pipelined module.
    """
    weights = loss_weights(calls, shift=shifts_labels(module))
    return weights if weights.exact else None


def column_of(outputs: Sequence[Any], key: str = "loss") -> Optional[int]:
    """The index of the call's loss (its ``key`` entry) among the tensor leaves of ``outputs[0]``, if
    it has one."""
    loss = loss_of(outputs[0], key)
    if loss is None:
        return None
    return next((i for i, t in enumerate(flatten(outputs[0])[0]) if t is loss), None)
