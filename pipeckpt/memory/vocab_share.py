"""The logits under a head split over the vocabulary, as one tensor-parallel rank holds them.

Under ``tensor_parallel`` the distributed engine splits a ``pipeline_of`` model's LM head ``colwise``
(its output features, the vocabulary: engines/distributed/vocab_plan.py); its logits stay a
vocabulary-sharded DTensor and the model's own loss runs on them under torch's ``loss_parallel``
(engines/distributed/vocab_loss.py), so each rank holds ``1/tp`` of every tensor shaped by the
vocabulary: the logits, their fp32 copy, the log-probabilities, their gradients and the head's
weight gradient. The profile measures the model's code outside its layers whole; this counts those
tensors' share, found by their shapes (:func:`~pipeckpt.memory.outside.vocab_sized`), never by module
names: what the loss saves (each storage's bytes), and the forward's and the head's backward's
peaks (from the frontier of bytes live at once, :func:`~pipeckpt.memory.outside.peak_over`). A head
the plan does not split (a tied one, or none) keeps its logits whole.
"""

from dataclasses import replace
from fnmatch import fnmatch
from typing import Dict, Optional, Sequence, Tuple

from pipeckpt.memory.outside import peak_over, vocab_sized
from pipeckpt.memory.profile import ModelProfile

__all__ = ["head_split", "split_over_vocabulary", "split_profiles"]


def head_split(head: str, tp: int, plan: Sequence[Tuple[str, str]]) -> bool:
    """Whether ``plan`` (``tensor_parallel_plan``'s entries: a module's path in the model, a style)
    splits the head at path ``head`` by its output features over ``tp > 1`` ranks (the first entry
    that matches its path picks its style, as the engine applies it)."""
    style = next((st for pattern, st in plan if head and fnmatch(head, pattern)), None)
    return tp > 1 and style == "colwise"


def split_over_vocabulary(profile: ModelProfile, tp: int, plan: Sequence[Tuple[str, str]]) -> ModelProfile:
    """``profile`` with the code after a ``pipeline_of`` model's layers counted as one of ``tp`` ranks
    runs it where ``plan`` splits its head (:func:`head_split`): each storage the loss link saves or
    returns that is shaped by the vocabulary is ``ceil(bytes / tp)``, and its forward and backward
    peaks are the most bytes live at once with the vocabulary's share, its loss as ``loss_parallel``
    runs it (memory/loss_parallel_bytes.py: more logits shards at once than aten's ops, so a peak
    can drop by less than the share, or rise). Else ``profile``.

    Args:
        profile: a profile of the whole model (one tensor-parallel rank's layers or not).
        tp: the tensor-parallel degree.
        plan: the entries of ``tensor_parallel_plan`` the engine applies.
    """
    o, loss = profile.outside, profile.loss
    if o is None or loss is None or not head_split(o.head, tp, plan):
        return profile
    sizes = dict(profile.storage_bytes)
    for i in {*loss.saved, *loss.outputs}:
        shape = profile.storage_shapes.get(i)
        if shape is not None and vocab_sized(shape, o.head_shape):
            sizes[i] = -(-sizes[i] // tp)
    # what the vocabulary's share takes off the peak, the loss's ops as loss_parallel runs them
    # (memory/loss_parallel_bytes.py): negative where those hold more than the share saves
    forward = peak_over(o.forward_points) - peak_over(o.split_forward_points, tp)
    backward = peak_over(o.backward_points) - peak_over(o.split_backward_points, tp)
    split = replace(
        loss,
        forward_peak=max(0, loss.forward_peak - forward),
        backward_peak=max(0, loss.backward_peak - backward),
        backward_held_peak=_less(loss.backward_held_peak, backward),
        first_backward_peak=_less(loss.first_backward_peak, backward),
    )
    return replace(profile, loss=split, storage_bytes=sizes)


def _less(value: Optional[int], by: int) -> Optional[int]:
    return None if value is None else max(0, value - by)


def split_profiles(
    profiles: Dict[int, ModelProfile], tp: int, plan: Sequence[Tuple[str, str]]
) -> Dict[int, ModelProfile]:
    """:func:`split_over_vocabulary` of each of ``profiles`` (by chunk count)."""
    return {c: split_over_vocabulary(p, tp, plan) for c, p in profiles.items()}
