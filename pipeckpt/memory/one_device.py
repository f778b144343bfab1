"""The whole process's peak when every stage runs on one device (the local engine on one CPU or GPU).

Why apart from the per-stage model: on one device the stages add up, but not at their own peaks'
sum: while one stage peaks in its backward, the others hold only what lives between their ops. A
``pipeline_of`` model is walked op by op as its ``forward`` runs (depth first,
:func:`~pipeckpt.memory.predict.predict_depth_first`); a Sequential's per-stage peaks are composed
(:func:`compose`), each stage's peak taken with what the others hold at that moment of torchgpipe's
clock. The reasoning is in docs/DESIGN.md, memory/auto.
"""

import re
from typing import List, Optional, Sequence, Union

import torch

from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.checkpointing.order import kept as kept_microbatches
from pipeckpt.memory.predict import predict, predict_depth_first
from pipeckpt.memory.profile import ModelProfile
from pipeckpt.memory.schedule import op_order
from pipeckpt.memory.stage_model import stage_model
from pipeckpt.memory.walk import StageMemory
from pipeckpt.stages.partition import StagePlan

__all__ = ["process_peak", "compose", "held_per_step", "gathered_gradient"]

_BACKWARD = re.compile(r"B(\d+) ")


def process_peak(
    profile: ModelProfile,
    plan: StagePlan,
    *,
    chunks: int,
    optimizer: Union[str, torch.optim.Optimizer, type] = "adam",
    accumulating: bool = False,
    stale_grads: bool = False,
) -> int:
    """The whole process's predicted peak bytes when every stage of ``plan`` runs on one device
    under the local engine: parameters, optimizer state, gradients, activations and working memory
    of all stages together at the worst moment."""
    if profile.outside is not None:  # a pipeline_of model: walked as it runs, depth first
        return predict_depth_first(
            profile,
            plan,
            chunks=chunks,
            optimizer=optimizer,
            accumulating=accumulating,
            stale_grads=stale_grads,
        ).peak
    prediction = predict(
        profile,
        plan,
        chunks=chunks,
        optimizer=optimizer,
        accumulating=accumulating,
        shared_device=True,
        stale_grads=stale_grads,
    )
    held = held_per_step(profile, plan.balance, plan.modes, chunks)
    tail = gathered_gradient(profile, plan.balance, chunks)
    return compose(list(prediction.stages), held, chunks, stale_grads, tail=tail)


def held_per_step(
    profile: ModelProfile, balance: Sequence[int], modes: Sequence[CheckpointMode], chunks: int
) -> List[int]:
    """Per stage, the bytes its micro-batches keep from their forward to their backward, all of them."""
    order, _ = op_order("local", stages=len(balance), microbatches=chunks)
    out, start = [], 0
    for j, (n, mode) in enumerate(zip(balance, modes)):
        # memory.py's per-stage model, read for one quantity it already computes (same package).
        model = stage_model(profile, start, start + n, first=j == 0, last=j == len(balance) - 1, local=True)
        keep = kept_microbatches([(j, kind, i) for kind, i in order[j]], j)
        total = 0
        for i in range(chunks):
            recompute = mode.recomputes(i, chunks, keep=keep)
            total += model.kept(mode, recompute, function=recompute or chunks > 1)
        if j == len(balance) - 1 and profile.outside is not None:  # a pipeline_of model's head
            total += chunks * profile.outside.held
        out.append(total)
        start += n
    return out


def gathered_gradient(profile: ModelProfile, balance: Sequence[int], chunks: int) -> int:
    """Bytes of the gradient of the gathered batch's output: one storage, of which each micro-batch's
    output gradient is a view, so all of it lives until the last stage's last backward (the walk's
    ``tail``). One micro-batch is handed back as it is: no gathered copy, its gradient the last
    stage's own."""
    if chunks == 1 or profile.outside is not None:
        return 0
    start = sum(balance[:-1])
    last = stage_model(profile, start, start + balance[-1], first=len(balance) == 1, last=True, local=True)
    return chunks * last.output_bytes


def compose(
    stages: Sequence[StageMemory],
    held: Sequence[int],
    chunks: int,
    stale_grads: bool = False,
    *,
    tail: int = 0,
) -> int:
    """The process peak from per-stage peaks: while stage j peaks (in its backward), the stages
    before it hold all they kept, those after it their gradients (frozen parameters have none) and
    the micro-batches their drain has not reached (stage j + d is about d micro-batches ahead of
    stage j), and the gathered output's gradient (``tail``) where the last stage has not yet run its
    last backward. ``stale_grads``: a peak in the forward also has the gradients of the stages
    before it from the step before."""
    static = sum(s.params + s.optimizer for s in stages)
    last = len(stages) - 1
    worst = 0
    for j, s in enumerate(stages):
        own = s.peak - s.params - s.optimizer
        if s.peak_at == "optimizer step":  # every gradient made, nothing else held
            worst = max(worst, own + sum(t.params - t.frozen for k, t in enumerate(stages) if k != j))
            continue
        before = sum(held[:j])
        if stale_grads and (s.peak_at.startswith("F") or s.peak_at == "gather"):
            before += sum(stages[k].params - stages[k].frozen for k in range(j))
        after = sum(
            stages[k].params - stages[k].frozen + held[k] * max(0, chunks - 1 - (k - j)) // chunks
            for k in range(j + 1, len(stages))
        )
        i = _backward_microbatch(s.peak_at)
        # Backward runs torchgpipe's clock in reverse, the last stage first in each cycle: while stage
        # j runs micro-batch i, the last stage has reached micro-batch i - (last - j).
        if j < last and i is not None and i > last - j:
            after += tail
        worst = max(worst, own + before + after)
    return static + worst


def _backward_microbatch(peak_at: str) -> Optional[int]:
    """The micro-batch of a peak in backward (``"B2 layer 6"``: 2), None for one elsewhere."""
    found = _BACKWARD.match(peak_at)
    return int(found.group(1)) if found else None
