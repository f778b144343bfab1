"""The op order each stage runs in one step under a schedule the memory model knows, and what
its sends hold meanwhile, and how a split backward's order reads to the model.

The orders themselves are :mod:`pipeckpt.checkpointing.order`'s, the ones the engines hand their
stages; torch's own schedule IR is read first where it lists every micro-batch once forward and
once backward, so a torch release that changes a schedule shows here. An op here is
``("F" | "B", micro-batch)``: one stage's, without the stage index.
"""

import functools
from typing import List, Sequence, Set, Tuple

from torch.distributed.pipelining.schedules import get_schedule_class

from pipeckpt._compat import schedule_op_order
from pipeckpt._errors import config_error
from pipeckpt.checkpointing.order import Op, gpipe_order, local_order, one_f_one_b_order

__all__ = ["SCHEDULES", "op_order", "sends_held", "split_backward"]

#: Schedules the model knows: the local engine, and torch's single-stage schedules by name.
SCHEDULES = ("local", "gpipe", "1f1b")


def op_order(schedule: str, *, stages: int, microbatches: int) -> Tuple[List[List[Tuple[str, int]]], str]:
    """Each stage's compute ops, ``("F" | "B", micro-batch)`` in the order it runs them, and
    where the order comes from: torch's schedule IR where it lists every micro-batch once forward
    then once backward, else :mod:`pipeckpt.checkpointing.order`'s (torch's IR misnumbers 1F1B's
    last rank).

    Args:
        schedule: one of :data:`SCHEDULES` (``local``: torchgpipe's fill-drain, backward from the
            last micro-batch; ``gpipe`` and ``1f1b``: torch's, backward from micro-batch 0).
        stages: stages in the pipeline.
        microbatches: micro-batches per step.
    """
    order, source = _op_order(str(schedule), stages, microbatches)
    return [list(ops) for ops in order], source


@functools.lru_cache(maxsize=512)
def _op_order(schedule: str, stages: int, m: int) -> Tuple[Tuple[Tuple[Tuple[str, int], ...], ...], str]:
    """:func:`op_order`, kept per arguments: a layout search asks it of thousands of predictions
    with the same few, and building torch's schedule IR each time was 15% of a 32-GPU search."""
    if schedule == "local":
        return tuple(tuple(_ops(local_order(j, m))) for j in range(stages)), (
            "torchgpipe fill-drain, backward from the last micro-batch"
        )
    name = _schedule_name(schedule)
    cls = get_schedule_class(name)
    ir = schedule_op_order(cls, stages=stages, microbatches=m)
    if ir is not None and all(_valid(ir.get(r, []), m) for r in range(stages)):
        return tuple(tuple(ir[r]) for r in range(stages)), f"{cls.__name__}'s op order (torch's schedule IR)"
    if cls.__name__ == "Schedule1F1B":
        order = tuple(tuple(_ops(one_f_one_b_order(j, stages, m))) for j in range(stages))
        return order, "Schedule1F1B: min(m, S - i) warm-up forwards, then 1B1F (its _step_microbatches)"
    order = tuple(tuple(_ops(gpipe_order(j, m))) for j in range(stages))
    return order, f"{cls.__name__}: all forwards, then backwards from micro-batch 0"


def _ops(order: Sequence[Op]) -> List[Tuple[str, int]]:
    """One stage's order without the stage index."""
    return [(kind, i) for _, kind, i in order]


def _schedule_name(schedule: str) -> str:
    if str(schedule).lower().replace("_", "") not in ("gpipe", "1f1b"):
        raise config_error(
            f"schedule={schedule!r}",
            f"the memory model knows {SCHEDULES}",
            "use 'local' (the local engine), 'gpipe' or '1f1b' (the distributed engine)",
        )
    return str(schedule).replace("_", "")


def _valid(ops: List[Tuple[str, int]], m: int) -> bool:
    forwards = [i for k, i in ops if k == "F"]
    backwards = [i for k, i in ops if k == "B"]
    if sorted(forwards) != list(range(m)) or sorted(backwards) != list(range(m)):
        return False
    done: Set[int] = set()
    for kind, i in ops:
        if kind == "F":
            done.add(i)
        elif i not in done:
            return False
    return True


def sends_held(
    schedule: str, ops: Sequence[Tuple[str, int]], *, stages: int, stage: int
) -> List[Tuple[int, int]]:
    """For each op of stage ``stage``'s order: how many outputs and how many input gradients of
    micro-batches whose backward is over are still alive while it runs, referenced by the sends
    torch's schedule posted (a send's op or work keeps its tensor until dropped). Read from
    torch's ``_step_microbatches``: GPipe keeps every forward and backward send until the step
    ends, so the k-th backward runs beside k outputs and k gradients; 1F1B keeps the latest
    backward's send until the next backward is over (one gradient from the first backward on),
    and the send of the next-to-last warm-up forward (micro-batch ``warm - 2``) until its
    one-backward-one-forward phase ends. The local engine sends nothing. Which of these a stage
    has (no output sent from the last, no gradient from the first) is the caller's to apply.

    Args:
        schedule: one of :data:`SCHEDULES`.
        ops: the stage's ops, as :func:`op_order` gives them.
        stages: stages in the pipeline.
        stage: the stage's index.
    """
    name = str(schedule).lower().replace("_", "")
    out: List[Tuple[int, int]] = []
    if name == "local":
        return [(0, 0)] * len(ops)
    warm = min(sum(1 for k, _ in ops if k == "F"), stages - stage)
    last_forward = max(n for n, (k, _) in enumerate(ops) if k == "F")
    warm_send = warm - 2  # 1F1B: the warm-up forward whose send stays referenced, if any
    backwards: Set[int] = set()
    phase_over = False  # 1F1B: the backward after the last forward has run
    for n, (kind, i) in enumerate(ops):
        if name == "gpipe":
            out.append((len(backwards), len(backwards)) if kind == "B" else (0, 0))
        else:
            outputs = int(warm_send >= 0 and warm_send in backwards and not phase_over)
            out.append((outputs, int(bool(backwards))))
        if kind == "B":
            backwards.add(i)
            phase_over = phase_over or n > last_forward
    return out


def split_backward(
    order: Sequence[Tuple[int, str, int]],
) -> Tuple[List[Tuple[int, str, int]], Set[Tuple[int, int]]]:
    """A device's order as the model walks it, and the ``(stage, micro-batch)`` pairs whose backward
    is split. A zero-bubble schedule's input pass (``"I"``) is the micro-batch's backward for
    memory: its recompute runs there and every layer's backward node with it (the weight gradients
    excepted); its weight pass (``"W"``) stays, to end what the micro-batch holds in between
    (``stage_model.between_passes``). A whole backward (``"B"``) in the same order stays one.

    Args:
        order: the device's ops ``(stage, "F" | "B" | "I" | "W", micro-batch)``.
    """
    split = {(j, i) for j, kind, i in order if kind == "W"}
    return [(j, "B" if kind == "I" else kind, i) for j, kind, i in order], split
