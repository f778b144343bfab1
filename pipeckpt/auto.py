"""Choosing each stage's checkpoint mode (and, if asked, chunks and balance) under a memory budget.

Why this is exact without trying every combination: in the memory model a stage's memory depends
on its own mode only (its layers, the chunks and the schedule fixed), so the feasible plans are a
product of per-stage feasible sets. When the candidate modes' recomputed micro-batches nest (never
within except_last within always = offload), moving any stage to a mode that recomputes less never
lengthens an op, and the step time, the longest path through the schedule's ops, never grows: the
fastest plan under the budget is, per stage, the feasible mode that recomputes least. Modes that
do not nest (granularity inside a stage, selective recompute) trade differently, so then every
combination of the per-stage feasible sets is predicted (a prediction takes well under a
millisecond). Chunks and balances, when given as candidates, are tried one by one.
tests/test_auto.py checks the result against brute force over every combination.
"""

import itertools
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import torch

from pipeckpt._errors import config_error
from pipeckpt.memory import ModelProfile, Prediction, StageMemory, predict, with_balance
from pipeckpt.modes import ALWAYS, EXCEPT_LAST, NEVER, SELECTIVE, CheckpointMode, parse_mode, parse_modes
from pipeckpt.planning import StagePlan
from pipeckpt.sizes import human, parse_bytes

__all__ = ["Choice", "choose", "parse_bytes", "DEFAULT_MODES", "TERMS", "MAX_COMBINATIONS"]

#: The modes ``choose`` considers by default: whole-stage recompute, per-layer and two-layer segments
#: (the backward holds one segment's recompute, not the stage's), and selective (torch's SAC: keep
#: matmul outputs, recompute the rest). Offload is ``always`` plus host copies: add it on CUDA.
DEFAULT_MODES: Tuple[CheckpointMode, ...] = (
    NEVER,
    EXCEPT_LAST,
    ALWAYS,
    parse_mode("except_last:1"),
    parse_mode("always:1"),
    parse_mode("always:2"),
    SELECTIVE,
)

Profiles = Union[ModelProfile, Mapping[int, ModelProfile]]


@dataclass(frozen=True)
class Choice:
    """The plan ``choose`` found, and the model's prediction for it."""

    modes: Tuple[CheckpointMode, ...]
    balance: Tuple[int, ...]
    chunks: int
    prediction: Prediction


def _recompute_rank(mode: CheckpointMode, chunks: int) -> Tuple[int, bool]:
    return (sum(1 for i in range(chunks) if mode.recomputes(i, chunks)), mode.offloads)


def _nested(modes: Sequence[CheckpointMode], chunks: int) -> bool:
    """Whether each mode's recomputed micro-batches include those of every mode ranked before it,
    and the modes differ in nothing else the time model sees (whole-stage recompute)."""
    if any(m.every is not None or m.selective for m in modes):
        return False  # granularity and selective trade memory for time otherwise than by micro-batch
    sets = sorted(({i for i in range(chunks) if m.recomputes(i, chunks)} for m in modes), key=len)
    return all(small <= large for small, large in itertools.pairwise(sets))


#: At most this many per-stage mode combinations are predicted for one (chunks, balance).
MAX_COMBINATIONS = 50_000


def choose(
    profiles: Profiles,
    budget_bytes: int,
    *,
    balance: Sequence[int],
    chunks: Union[int, Sequence[int]],
    optimizer: Union[str, torch.optim.Optimizer, type] = "adam",
    schedule: str = "local",
    modes: Sequence[Union[str, CheckpointMode]] = DEFAULT_MODES,
    balances: Optional[Sequence[Sequence[int]]] = None,
    accumulating: bool = False,
    shared_device: bool = False,
) -> Choice:
    """The per-stage modes (and chunks and balance among the candidates) with the least predicted
    step time whose every stage's predicted peak is at most ``budget_bytes``.

    ``profiles``: one :class:`~pipeckpt.memory.ModelProfile` (``chunks`` a single count), or a
    mapping from each candidate chunk count to the profile of its micro-batch (batch / chunks).
    ``balance``: the stages' layer counts; ``balances``: candidate balances to search instead.
    ``modes``: the candidate modes per stage. The other arguments are
    :func:`~pipeckpt.memory.predict`'s. Raises a config error stating the smallest feasible
    budget, and the stage that decides it, when nothing fits.
    """
    chunk_options = [chunks] if isinstance(chunks, int) else list(chunks)
    by_chunks = {c: profiles for c in chunk_options} if isinstance(profiles, ModelProfile) else dict(profiles)
    missing = [c for c in chunk_options if c not in by_chunks]
    if missing:
        raise config_error(
            f"chunks {missing}",
            "each candidate chunk count needs the profile of its micro-batch",
            "pass profiles as {chunks: profile(sequential, batch.chunk(chunks)[0], ...)}",
        )
    candidates = [parse_modes([m], 1)[0] for m in modes]
    balance_options = [tuple(b) for b in balances] if balances is not None else [tuple(balance)]
    best: Optional[Choice] = None
    smallest: Optional[Tuple[int, StageMemory, int, Tuple[int, ...]]] = None  # budget, stage, chunks, balance
    for c in chunk_options:
        nested = _nested(candidates, c)
        ranked = sorted(candidates, key=lambda m: _recompute_rank(m, c))
        for b in balance_options:
            per_mode = {
                m.name: predict(
                    by_chunks[c],
                    with_balance_modes(b, m),
                    chunks=c,
                    optimizer=optimizer,
                    schedule=schedule,
                    accumulating=accumulating,
                    shared_device=shared_device,
                )
                for m in ranked
            }
            fits: List[List[CheckpointMode]] = []
            need: List[Tuple[int, StageMemory]] = []
            for j in range(len(b)):
                fits.append([m for m in ranked if per_mode[m.name].stages[j].peak <= budget_bytes])
                cheapest = min((per_mode[m.name].stages[j] for m in ranked), key=lambda s: s.peak)
                need.append((cheapest.peak, cheapest))
            decisive = max(range(len(b)), key=lambda j: need[j][0])
            if smallest is None or need[decisive][0] < smallest[0]:
                smallest = (need[decisive][0], need[decisive][1], c, b)
            if not all(fits):
                continue
            combos = [tuple(f[0] for f in fits)] if nested else _combinations(fits)
            for picked in combos:
                prediction = predict(
                    by_chunks[c],
                    with_balance(_cpu_plan(b), b, picked),
                    chunks=c,
                    optimizer=optimizer,
                    schedule=schedule,
                    accumulating=accumulating,
                    shared_device=shared_device,
                )
                key = (prediction.step_time_s, prediction.peak)
                if best is None or key < (best.prediction.step_time_s, best.prediction.peak):
                    best = Choice(modes=tuple(picked), balance=b, chunks=c, prediction=prediction)
    if best is None:
        assert smallest is not None
        least, stage, c, b = smallest
        term, size = max(((t, getattr(stage, t)) for t in TERMS), key=lambda kv: kv[1])
        raise config_error(
            f"memory budget {human(budget_bytes)}",
            f"no plan fits: the smallest feasible budget is {human(least)} ({least} bytes), decided by "
            f"stage {stage.stage} (layers {stage.layers[0]}-{stage.layers[1] - 1}) with chunks={c}, "
            f"balance={list(b)} in its least-memory mode {stage.mode}, whose largest term is {term} "
            f"({human(size)}; {_terms(stage)})",
            f"raise memory.budget to at least {human(least)}, or add chunks, stages or devices",
        )
    return best


def _combinations(fits: Sequence[Sequence[CheckpointMode]]) -> List[Tuple[CheckpointMode, ...]]:
    count = 1
    for f in fits:
        count *= len(f)
    if count > MAX_COMBINATIONS:
        raise config_error(
            f"{count} per-stage mode combinations",
            f"choose predicts at most {MAX_COMBINATIONS} combinations of modes that do not nest",
            "pass fewer candidate modes, or fewer stages",
        )
    return list(itertools.product(*fits))


#: The parts of a stage's peak, as :class:`~pipeckpt.memory.StageMemory` names them.
TERMS = ("params", "grads", "optimizer", "activations", "boundary", "working")


def _terms(stage: StageMemory) -> str:
    return ", ".join(f"{t} {human(getattr(stage, t))}" for t in TERMS)


def _cpu_plan(balance: Sequence[int]) -> StagePlan:
    return StagePlan(
        balance=tuple(balance), devices=(torch.device("cpu"),) * len(balance), modes=(NEVER,) * len(balance)
    )


def with_balance_modes(balance: Sequence[int], mode: CheckpointMode) -> StagePlan:
    """A plan of ``balance`` with ``mode`` on every stage."""
    return with_balance(_cpu_plan(balance), balance, (mode,) * len(balance))
