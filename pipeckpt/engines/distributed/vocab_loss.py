"""The loss over a head split by the vocabulary, computed without gathering the logits.

Why: the head's logits are the largest activation of a language model (``batch x seq x vocab``).
Where the engine splits the model's output head over the vocabulary (:mod:`.vocab_plan`), the head
returns its logits as a DTensor sharded over ``tp`` by the vocabulary, and the model's own code
computes its loss on it: torch's ``loss_parallel`` makes ``cross_entropy`` on such a DTensor reduce
each token's maximum and sum of exponentials over the ``tp`` ranks (torchtitan's loss), so no rank
holds a whole row of logits; any other operation on a DTensor computes what it computes on the whole
tensor (gathering what it needs). The same numbers as the whole head, up to the order of a sum.
``loss_parallel`` covers the backward as well, so it is entered around the schedule's whole step
(forward and backward, every stage: it changes nothing but ``cross_entropy``'s ops on DTensors).

What the user's step receives: the model's loss as a plain tensor; in a training step, the logits as
the DTensor (``.full_tensor()`` gathers them); in a forward-only step (validation, prediction) each
output whole, as without tensor parallelism.
"""

from contextlib import AbstractContextManager, nullcontext
from typing import Any, List, Optional

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from pipeckpt._compat import tree_map
from pipeckpt._errors import PipeckptConfigError, config_error

__all__: List[str] = []


def parallel_loss(on: bool) -> AbstractContextManager[None]:
    """``loss_parallel`` where this rank's head is split over the vocabulary (``on``), else nothing."""
    return loss_parallel() if on else nullcontext()


def plain_loss(loss: Tensor) -> Tensor:
    """``loss`` as a plain tensor: a DTensor's local value where it is replicated (the model's
    loss over the split vocabulary: every rank holds it whole), else gathered; keeps the graph."""
    if not isinstance(loss, DTensor):
        return loss
    if all(p.is_replicate() for p in loss.placements):
        return loss.to_local()
    return loss.full_tensor()


def whole_outputs(output: Any) -> Any:
    """``output`` with each DTensor in it gathered whole (a forward-only step's logits)."""
    return tree_map(lambda t: plain_loss(t) if isinstance(t, DTensor) else t, output)


def split_logits_read(error: BaseException, module: object) -> Optional[PipeckptConfigError]:
    """The error a training step raised mixing the split logits with a plain tensor, named (None:
    another error). torch refuses an operation on a DTensor and a plain tensor together."""
    text = str(error)
    if not isinstance(error, (RuntimeError, TypeError)) or "DTensor" not in text:
        return None
    return config_error(
        f"{type(module).__name__}.training_step on the logits split over the vocabulary "
        f"({text.splitlines()[0] if text else type(error).__name__})",
        "under tensor_parallel the model's head returns its logits as a DTensor split over the "
        "vocabulary, and the model's loss is computed on it without gathering them; the step used "
        "them with a plain tensor",
        "gather them where the step needs them whole (logits.full_tensor()), or give "
        "tensor_parallel_plan without the head's entry (the head is then held whole)",
    )
