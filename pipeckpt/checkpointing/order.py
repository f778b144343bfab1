"""The op order a stage runs in one step under each schedule, and which micro-batches
``except_last`` keeps: the one source of op orders, for the engines and the memory model.

Why from the order and not from the micro-batch index: which recompute buys no memory depends on the
schedule (the local engine drains backward from the last micro-batch, torch's GPipe and 1F1B from
micro-batch 0). A micro-batch is kept when its backward is the stage's first backward, or when
nothing runs on the stage's device between its forward and its backward. An order is a list of
``(stage, kind, micro-batch)``, ``kind`` ``"F"`` or ``"B"``: one device's ops (docs/DESIGN.md,
checkpointing/order).
"""

from itertools import pairwise
from typing import FrozenSet, List, Sequence, Tuple

__all__ = ["Op", "local_order", "gpipe_order", "one_f_one_b_order", "kept"]

Op = Tuple[int, str, int]  # (stage index, "F" | "B" | other op kinds, micro-batch)


def local_order(stage: int, microbatches: int) -> List[Op]:
    """The local engine's: forward of every micro-batch, then backward from the last.

    Args:
        stage: the stage's index.
        microbatches: micro-batches per step.
    """
    forward = [(stage, "F", i) for i in range(microbatches)]
    return forward + [(stage, "B", i) for i in reversed(range(microbatches))]


def gpipe_order(stage: int, microbatches: int) -> List[Op]:
    """``torch.distributed.pipelining.ScheduleGPipe``'s on one stage: all forwards, then the
    backwards from micro-batch 0 (as its ``_step_microbatches`` runs them).

    Args:
        stage: the stage's index.
        microbatches: micro-batches per step.
    """
    return [(stage, kind, i) for kind in ("F", "B") for i in range(microbatches)]


def one_f_one_b_order(stage: int, stages: int, microbatches: int) -> List[Op]:
    """``Schedule1F1B``'s on stage ``stage`` of ``stages``: ``stages - stage`` warm-up forwards
    (fewer if there are fewer micro-batches), then one backward and one forward in turn, then
    the remaining backwards. Derived from what ``_step_microbatches`` runs: torch's own
    ``pipeline_order`` for this schedule omits micro-batch 0's forward on the last stage.

    Args:
        stage: the stage's index.
        stages: stages in the pipeline.
        microbatches: micro-batches per step.
    """
    warmup = min(microbatches, stages - stage)
    order: List[Op] = [(stage, "F", i) for i in range(warmup)]
    forward = warmup
    for backward in range(microbatches):
        order.append((stage, "B", backward))
        if forward < microbatches:
            order.append((stage, "F", forward))
            forward += 1
    return order


def kept(order: Sequence[Op], stage: int) -> FrozenSet[int]:
    """The micro-batches ``stage`` need not recompute under ``except_last``: the one whose backward
    is the stage's first (keeping it replaces a recompute that would hold as much), and any whose
    backward follows its own forward with nothing between on the device (its activations never
    coexist with another micro-batch's work).

    Args:
        order: the ops of the device that runs ``stage``.
        stage: the stage's index.
    """
    keep = set()
    backwards = [op for op in order if op[0] == stage and op[1] == "B"]
    if backwards:
        keep.add(backwards[0][2])
    for before, after in pairwise(order):
        if before[0] == after[0] == stage and (before[1], after[1]) == ("F", "B") and before[2] == after[2]:
            keep.add(before[2])
    return frozenset(keep)
