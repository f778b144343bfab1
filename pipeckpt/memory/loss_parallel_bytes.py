"""What torch's ``loss_parallel`` holds beyond aten's own loss ops, on one rank's share of the logits.

Why: a rank whose head the plan splits over the vocabulary runs the model's cross-entropy under
``loss_parallel`` (engines/distributed/vocab_loss.py), whose handlers replace aten's ops on the
logits' shard (torch/distributed/tensor/parallel/loss.py):

- its log-softmax makes ``x - max`` and that one's ``exp`` before the result, where aten's makes
  the result alone: two logits-shaped tensors live at once beside the input, not one;
- its NLL backward makes the gradient of both ops at once, ``(zeros + exp(x)) * grad``: a zeroed
  tensor, their sum and the product live at once, where aten's makes one zeroed tensor;
- its log-softmax backward hands that gradient on (``grad.to(dtype)``: the same tensor), where
  aten's makes another.

The profile runs aten's ops (memory/outside.py counts them); these say how loss_parallel's differ,
so the count can keep a second frontier as a split head's rank holds the bytes. Measured by the CPU
allocator on the Llama of benchmarks/RESULTS_layout.md ("What the operator count cannot see"), the
last stage at pp2 x tp2 held 36 MiB more than a count of aten-level ops sees, most of it these.
Assumed: the logits reach the loss in its computation dtype (fp32: Hugging Face's losses upcast
them first), so no conversion copy is made.
"""

from typing import Any, Optional

from torch import Tensor

__all__ = ["handed_on", "held_at_once"]

#: logits-shaped tensors loss_parallel holds at once while the op runs, its output among them
_AT_ONCE = {"aten._log_softmax.default": 2, "aten.nll_loss_backward.default": 3}


def held_at_once(func: Any, out: Any) -> int:
    """Bytes of logits-shaped tensors that loss_parallel's version of ``func`` holds at once while it
    runs, its output ``out`` among them (0 for an op it does not replace)."""
    k = _AT_ONCE.get(str(func), 0)
    if not k or not isinstance(out, Tensor):
        return 0
    return k * out.untyped_storage().nbytes()


def handed_on(func: Any, args: Any, out: Any) -> Optional[Tensor]:
    """The input whose storage loss_parallel's version of ``func`` returns as ``out`` (the
    log-softmax backward hands its incoming gradient on), or None."""
    if str(func) != "aten._log_softmax_backward_data.default" or not isinstance(out, Tensor):
        return None
    grad = args[0]
    return grad if isinstance(grad, Tensor) and grad.dtype == out.dtype else None
