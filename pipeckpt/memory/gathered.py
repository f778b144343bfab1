"""Which of a stage's FSDP2 units a rank holds gathered at one of the walk's ops, under
``reshard_after_forward``.

Why it follows the schedule's op order: torch's ``PipelineStage`` turns FSDP2's reshard after
backward off for every micro-batch (``backward_maybe_with_nosync``) until the step's
``perform_reduce_grad``, while each forward still reshards a unit once it has run. So a unit that a
backward gathered stays gathered until the next forward passes it: in a forward after a backward,
the units it has not reached yet; in a backward after a forward, those whose backward it has run;
in a backward right after another (a fill-drain schedule's drain), every unit; at a loss, none
(tests/memory/test_gathered_units.py measures the first three on FSDP2 itself). Measured on the
Llama of benchmarks/RESULTS_layout.md: at pp1 x fsdp 2 the step peaks in the loss's backward, before
the head's, 30.1 MiB (every unit's gathered bytes) under the peak without the reshard; and the
rule held every unit gathered after a backward, whatever came after it, so the pp2 x dp2 rows under
1F1B with the reshard were over by 11-18%.
"""

import re
from typing import Optional, Sequence, Tuple

__all__ = ["LOSS_OPS", "StageOrder", "gathered"]

#: The walk's loss ops (pipeckpt/memory/walk.py): a pipelined stage's, and a local one's.
LOSS_OPS = r"[FB]\d+ loss$|loss (?:forward|backward)$"
_LOSS = re.compile(rf"(?:stage \d+ )?(?:{LOSS_OPS})")

#: One stage's compute ops in the order it runs them, ``("F" | "B", micro-batch)``
#: (:func:`pipeckpt.memory.schedule.op_order`).
StageOrder = Sequence[Tuple[str, int]]

# The walk's ops that name a micro-batch and a layer or a part (pipeckpt/memory/walk.py).
_OP = re.compile(r"(?:stage \d+ )?([FB])(\d+) (?:(?:recompute )?layer (\d+)|(loss|outside|embeddings))$")


def gathered(
    at: str,
    layers: Tuple[int, int],
    whole: int,
    two: int,
    backward_share: Optional[float],
    order: Optional[StageOrder],
) -> int:
    """Compute-dtype bytes of the stage's units gathered at the walk's op ``at``.

    Args:
        at: the op.
        layers: the stage's ``(start, stop)`` in the Sequential (the op names a layer by its index).
        whole: every unit of the stage gathered.
        two: the running unit and the prefetched one.
        backward_share: where ``order`` does not place the op, the share of the stage's gradients
            the op holds if it falls where the backward has begun, else None; the units whose
            gradients it holds are then counted gathered, and none at a loss.
        order: the stage's ops in the schedule's order; None where the memory model has none
            (the looped schedules).
    """
    op = _OP.match(at)
    if order is None or op is None or (op.group(1), int(op.group(2))) not in order:
        if backward_share is not None:
            return min(whole, round(backward_share * whole) + two)
        return 0 if _LOSS.match(at) else two
    kind, i, layer, part = op.group(1), int(op.group(2)), op.group(3), op.group(4)
    before = order[: order.index((kind, i))]
    backwards = [n for n, (k, _) in enumerate(before) if k == "B"]
    start, stop = layers
    after = 0.0 if layer is None else min(1.0, max(0.0, (stop - 1 - int(layer)) / max(stop - start, 1)))
    if kind == "F":  # the forward resharded the units before this op; a backward before it gathered the rest
        if part == "loss":
            return 0
        return min(whole, round(after * whole) + two) if backwards else two
    if backwards and not any(k == "F" for k, _ in before[backwards[-1] + 1 :]):
        return whole  # right after another backward: every unit still gathered from it
    if part == "loss":  # the forward before it resharded every unit, none gathered again yet
        return 0
    if part == "embeddings":  # every layer's backward has run in this micro-batch
        return whole
    if part == "outside":  # the head's backward, before the layers'
        return two
    return min(whole, round(after * whole) + two)
