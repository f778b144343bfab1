"""One rank's peak: a stage's predicted walk with the rank's own shares of its training state.

Why apart from the shares (memory/sharding.py): those follow from shapes alone; where the peak falls
follows from the walk's ops. The walk counts the stage's state whole, so the rank's peak is taken
again over the walk's candidate ops with the rank's shares (memory/stage_memory.py says why).
"""

import functools
import re
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from pipeckpt.memory.gathered import LOSS_OPS, StageOrder, gathered
from pipeckpt.memory.predict import Prediction
from pipeckpt.memory.schedule import SCHEDULES, op_order
from pipeckpt.memory.sharding import Layout, RankState, rank_state, reduced_in_backward
from pipeckpt.memory.stage_memory import Candidate, StageMemory

__all__ = [
    "RankMemory",
    "RankTable",
    "before_gradients",
    "per_rank",
    "on_rank",
    "stage_orders",
    "rank_table",
    "format_ranks",
]

GiB, MiB = 2**30, 2**20


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted memory (bytes) at its stage's peak."""

    stage: int
    layers: Tuple[int, int]
    mode: str
    state: RankState
    activations: int
    boundary: int
    working: int
    peak: int
    peak_at: str


# The walk's points before a stage's backward has made any gradient: its forwards, the gather, and
# the loss (its backward runs before the head's). pipeckpt/memory/walk.py names them.
_BEFORE_GRADIENTS = re.compile(rf"(?:stage \d+ )?(?:F\d+ |gather$|{LOSS_OPS})")


#: The op :func:`per_rank` adds after a stage's last backward under FSDP with gradient sync deferred:
#: torch's ``PipelineStage.perform_reduce_grad`` reduces every unit's whole gradient.
REDUCING = "reduce gradients"


# The walk's backward ops of the units outside the layers: the head's, the embeddings'.
_OUTSIDE = re.compile(r"(?:stage \d+ )?B\d+ (?:outside|embeddings)$")


def before_gradients(peak_at: str) -> bool:
    """Whether the walk's op ``peak_at`` comes before its micro-batch's backward makes a gradient (a
    forward, the gather, the loss); whether an earlier micro-batch's backward made some, only the
    gradients the walk holds there (``StageMemory.grads``) tell."""
    return _BEFORE_GRADIENTS.match(peak_at) is not None


def per_rank(stage: StageMemory, state: RankState, order: Optional[StageOrder] = None) -> RankMemory:
    """A stage's predicted peak on one of its ranks: the walk's activations, boundary and working set
    (profiled on one tensor-parallel rank's layers in the compute dtype) with the stage's parameters,
    gradients and optimizer state replaced by the rank's sharded ones, at whichever of the walk's
    candidate ops (``StageMemory.candidates``: per amount of gradients held, the op holding the most
    beside them) is then the largest, or the step's deferred gradient reduction (``REDUCING``).
    The gradients count in the share the walk held there (all, unless it falls in the first
    backward): whole until the reduction under FSDP (``RankState.grads_backward``), sharded at the
    optimizer step; the collective buffers only where a gradient can have been made, in a backward,
    so a peak at the first micro-batch's loss (Llama 3.1 8B at fsdp 8, one micro-batch) has none.

    Args:
        stage: the walk's prediction for the stage, parameters in the compute dtype.
        state: :func:`rank_state` of the stage's layers.
        order: the stage's ops in the schedule's order (:func:`stage_orders`), which tells which
            units are gathered at an op under ``reshard_after_forward``; None: where the model has none.
    """
    if order is not None and sum(kind == "B" for kind, _ in order) == 1:
        state = reduced_in_backward(state)  # one micro-batch a step: reduced in its backward
    rest = stage.peak - stage.params - stage.grads - stage.optimizer
    peak = (stage.grads, stage.activations, stage.boundary, stage.working, stage.peak_at)
    tried = [(peak, rest, order)] + [(c, c[1] + c[2] + c[3], order) for c in stage.candidates]
    if state.grads_backward is not None:  # after the last backward, before the optimizer's step
        tried.append(((stage.params - stage.frozen, 0, 0, 0, REDUCING), 0, None))
    # Only the largest becomes a RankMemory: a search asks this of millions of candidate ops.
    best = (peak, _terms(stage, state, peak, rest, order))
    for candidate, beside, at_order in tried[1:]:
        terms = _terms(stage, state, candidate, beside, at_order)
        if terms[0] > best[1][0]:  # the first of equal ones: the walk's own peak
            best = (candidate, terms)
    return _memory(stage, state, *best)


def _at(
    stage: StageMemory, state: RankState, candidate: Candidate, rest: int, order: Optional[StageOrder] = None
) -> RankMemory:
    """The rank's memory at one op (:func:`_terms`)."""
    return _memory(stage, state, candidate, _terms(stage, state, candidate, rest, order))


def _memory(
    stage: StageMemory, state: RankState, candidate: Candidate, terms: Tuple[int, int, int, int]
) -> RankMemory:
    top, grads, unsharded, collectives = terms
    _, activations, boundary, working, at = candidate
    return RankMemory(
        stage=stage.stage,
        layers=stage.layers,
        mode=stage.mode,
        state=replace(state, grads=grads, unsharded=unsharded, collectives=collectives),
        activations=activations,
        boundary=boundary,
        working=working,
        peak=top,
        peak_at=at,
    )


def _terms(
    stage: StageMemory, state: RankState, candidate: Candidate, rest: int, order: Optional[StageOrder] = None
) -> Tuple[int, int, int, int]:
    """The rank's memory at one op, ``(peak, gradients, gathered parameters, collective buffers)``:
    ``rest`` beside the gradients the op holds (``candidate``); ``order``: the stage's ops in the
    schedule's order, where the memory model has it."""
    held, _, _, _, at = candidate
    trained = stage.params - stage.frozen
    share = held / trained if trained else 0.0
    grads = round(share * state.grads)
    # FSDP2 reshards every unit after its backward and frees its reduce-scatter buffers, so the
    # optimizer step holds neither (seen on a one-process fake world of 2, reshard_after_forward=False:
    # after the backward every unit's group was resharded, and the bytes alive beyond the sharded
    # parameters were the sharded gradients, 279,168 of the tiny Llama's, exactly).
    stepping, reducing = at == "optimizer step", at == REDUCING
    backward = held or not before_gradients(at)
    unsharded = 0 if stepping else state.unsharded
    again = state.unsharded_backward  # units gathered for a backward are kept (memory/gathered.py)
    if again is not None and not stepping:
        share_if = share if backward else None
        unsharded = again if reducing else gathered(at, stage.layers, again, state.unsharded, share_if, order)
    if state.grads_backward is not None and not stepping:  # whole until the step reduces them
        grads = round(share * state.grads_backward)
    collectives = 0 if stepping or not backward else state.collectives
    if _OUTSIDE.match(at):
        collectives = max(collectives, state.outside_collectives)
    elif reducing:
        collectives = state.reducing + state.staged_reducing
    if backward and not stepping and not reducing:  # gloo's copy of a reduce-scatter before it
        collectives += state.staged
    return (
        rest + state.params + grads + state.optimizer + unsharded + collectives,
        grads,
        unsharded,
        collectives,
    )


def stage_orders(schedule: str, stages: int, chunks: int) -> Tuple[Optional[StageOrder], ...]:
    """Each stage's ops in ``schedule``'s order, for :func:`per_rank`; None for every stage of a
    schedule the memory model has no order of (the looped ones)."""
    return _orders(str(schedule), stages, chunks)


@functools.lru_cache(maxsize=256)
def _orders(schedule: str, stages: int, chunks: int) -> Tuple[Optional[StageOrder], ...]:
    if schedule not in SCHEDULES or schedule == "local" or chunks < 1:
        return (None,) * stages
    return tuple(tuple(ops) for ops in op_order(schedule, stages=stages, microbatches=chunks)[0])


def on_rank(
    stage: StageMemory,
    state: RankState,
    whole: Optional[RankState] = None,
    order: Optional[StageOrder] = None,
) -> StageMemory:
    """:func:`per_rank` in the walk's own terms, for the planners that compare a stage's peak with a
    budget (``checkpoint='auto'``): the parameters held are the rank's shards and the gathered
    parameters, its working set takes FSDP's collective buffers; the peak is :func:`per_rank`'s.

    Args:
        stage: the walk's prediction for the stage.
        state: :func:`rank_state` of the stage's layers.
        whole: :func:`rank_state` of the same layers unsharded (``Layout(precision=...)``): what the
            walk counts beyond them (a ``pipeline_of`` model's own parameters, on its last stage)
            stays whole on every rank, as the engine shards the layers only. None: nothing beyond.
        order: the stage's ops in the schedule's order (:func:`stage_orders`).
    """
    if whole is not None:
        extra = stage.params - whole.params
        grads = stage.params - stage.frozen - whole.grads  # whole on every rank
        state = replace(
            state,
            params=state.params + extra,
            grads=state.grads + grads,
            optimizer=state.optimizer + stage.optimizer - whole.optimizer,
            grads_backward=None if state.grads_backward is None else state.grads_backward + grads,
        )
    rank = per_rank(stage, state, order)
    return replace(
        stage,
        params=rank.state.params + rank.state.unsharded,
        frozen=state.params - state.grads,
        grads=rank.state.grads,
        optimizer=rank.state.optimizer,
        activations=rank.activations,
        boundary=rank.boundary,
        working=rank.working + rank.state.collectives,
        peak=rank.peak,
        peak_at=rank.peak_at,
    )


@dataclass(frozen=True)
class RankTable:
    """Every stage's memory on one of its ranks, under one layout and schedule."""

    ranks: Tuple[RankMemory, ...]
    layout: Layout
    schedule: str
    chunks: int

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)


def rank_table(
    prediction: Prediction,
    sequential: nn.Sequential,
    ranges: Sequence[Tuple[int, int]],
    layout: Layout,
    optimizer: Union[str, torch.optim.Optimizer, type] = "adamw",
) -> RankTable:
    """:func:`per_rank` for every stage of ``prediction``, each layer of ``sequential`` an FSDP2 unit.

    Args:
        prediction: the walk's prediction on one tensor-parallel rank's layers, in the compute dtype.
        sequential: those layers.
        ranges: each stage's ``(start, stop)`` in ``sequential``.
        layout: degrees, reshard policy and precision.
        optimizer: whose state to count.
    """
    layers = list(sequential)
    orders = stage_orders(prediction.schedule, len(prediction.stages), prediction.chunks)
    ranks = tuple(
        per_rank(s, rank_state(layers[a:b], layout, optimizer), order)
        for s, (a, b), order in zip(prediction.stages, ranges, orders)
    )
    return RankTable(ranks=ranks, layout=layout, schedule=prediction.schedule, chunks=prediction.chunks)


COLUMNS = ("params", "grads", "optimizer", "unsharded", "collectives")


def format_ranks(table: RankTable) -> str:
    """One row per stage: one rank's memory at the stage's peak (GiB, or MiB below one GiB)."""
    lay = table.layout
    unit, name = (GiB, "GiB") if table.peak >= GiB else (MiB, "MiB")
    lines = [
        f"one rank per stage: fsdp {lay.fsdp}, tp {lay.tp}, reshard_after_forward "
        f"{lay.reshard_after_forward}, {lay.precision}"
        + (", gradients reduced every micro-batch" if lay.reduce_every_microbatch else "")
        + (", sequence parallel" if lay.sequence_parallel else "")
        + f"; schedule {table.schedule}, "
        f"chunks {table.chunks}; {name}",
        f"{'stage':>5} {'layers':>7} {'mode':>11} "
        + " ".join(f"{c:>11}" for c in (*COLUMNS, "activations", "boundary", "working", "peak"))
        + "  at",
    ]
    for r in table.ranks:
        values = [getattr(r.state, c) for c in COLUMNS] + [r.activations, r.boundary, r.working, r.peak]
        lines.append(
            f"{r.stage:>5} {f'{r.layers[0]}-{r.layers[1] - 1}':>7} {r.mode:>11} "
            + " ".join(f"{v / unit:>11.2f}" for v in values)
            + f"  {r.peak_at}"
        )
    return "\n".join(lines)
