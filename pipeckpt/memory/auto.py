"""Choosing each stage's checkpoint mode (and, if asked, chunks and balance) under a memory budget.

Exact without trying every combination: a stage's memory depends on its own mode only, so the
feasible plans are a product of per-stage sets, and where the modes' recomputes nest the fastest
plan is, per stage, the feasible mode that recomputes least; otherwise every combination is scored
(a prediction costs well under a millisecond). The reasoning, and the one-device process peak, are
in docs/DESIGN.md, memory/auto; tests/memory/test_auto.py checks it against brute force.
"""

import functools
import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from pipeckpt._errors import config_error
from pipeckpt.checkpointing.modes import (
    ALWAYS,
    EXCEPT_LAST,
    NEVER,
    SELECTIVE,
    CheckpointMode,
    parse_mode,
    parse_modes,
)
from pipeckpt.memory.fastest_first import fastest_first
from pipeckpt.memory.one_device import compose, gathered_gradient, held_per_step, process_peak
from pipeckpt.memory.predict import Prediction, predict, predict_depth_first, with_balance
from pipeckpt.memory.profile import ModelProfile
from pipeckpt.memory.rank_peak import on_rank, stage_orders
from pipeckpt.memory.sharding import RankState
from pipeckpt.memory.walk import StageMemory
from pipeckpt.sizes import human, parse_bytes
from pipeckpt.stages.partition import StagePlan

__all__ = ["Choice", "choose", "parse_bytes", "process_peak", "DEFAULT_MODES", "TERMS", "MAX_COMBINATIONS"]

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
    #: ``shared_device``: the whole process's predicted peak (:func:`process_peak`), else None.
    process_peak: Optional[int] = None


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
    stale_grads: bool = False,
    rank_states: Optional[Callable[[Tuple[int, ...]], Sequence[Tuple[RankState, RankState]]]] = None,
) -> Choice:
    """The per-stage modes (and chunks and balance among the candidates) with the least predicted
    step time whose every stage's predicted peak is at most ``budget_bytes``.

    ``profiles``: one :class:`~pipeckpt.memory.profile.ModelProfile` (``chunks`` a single count), or a
    mapping from each candidate chunk count to the profile of its micro-batch (batch / chunks).
    ``balance``: the stages' layer counts; ``balances``: candidate balances to search instead.
    ``modes``: the candidate modes per stage. The other arguments are
    :func:`~pipeckpt.memory.predict.predict`'s. ``rank_states``: for a balance, each stage's
    training state on one of its ranks and unsharded (:func:`~pipeckpt.memory.sharding.rank_state`),
    where the stages are sharded: the peaks compared with the budget are then one rank's
    (:func:`~pipeckpt.memory.rank_peak.on_rank`). Raises a config error stating the smallest feasible
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
        predicted = functools.partial(
            _predict_on_ranks,
            by_chunks[c],
            rank_states,
            chunks=c,
            optimizer=optimizer,
            schedule=schedule,
            accumulating=accumulating,
            shared_device=shared_device,
            stale_grads=stale_grads,
        )
        for b in balance_options:
            per_mode = {m.name: predicted(with_balance_modes(b, m)) for m in ranked}
            if shared_device:
                whole_of = None
                if by_chunks[c].outside is not None:
                    whole_of = functools.partial(
                        _depth_first_peak,
                        by_chunks[c],
                        b,
                        chunks=c,
                        optimizer=optimizer,
                        accumulating=accumulating,
                        stale_grads=stale_grads,
                    )
                found, lowest = _search_shared(
                    by_chunks[c], b, c, ranked, per_mode, budget_bytes, stale_grads, whole_of
                )
                if smallest is None or lowest[0] < smallest[0]:
                    smallest = (lowest[0], lowest[1], c, b)
                if found is not None:
                    picked, whole = found
                    prediction = predicted(with_balance(_cpu_plan(b), b, picked))
                    key = (prediction.step_time_s, whole)
                    if best is None or key < (best.prediction.step_time_s, best.process_peak or 0):
                        best = Choice(tuple(picked), b, c, prediction, process_peak=whole)
                continue
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
                prediction = predicted(with_balance(_cpu_plan(b), b, picked))
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
            f"raise memory_budget (memory.budget in the app) to at least {human(least)}, or add chunks, "
            "stages or devices",
        )
    return best


def _predict_on_ranks(
    profile: ModelProfile,
    rank_states: Optional[Callable[[Tuple[int, ...]], Sequence[Tuple[RankState, RankState]]]],
    plan: StagePlan,
    **options: Any,
) -> Prediction:
    """:func:`~pipeckpt.memory.predict.predict`, each stage's memory one of its ranks' where
    ``rank_states`` says how the stages are sharded."""
    prediction = predict(profile, plan, **options)
    if rank_states is None:
        return prediction
    states = rank_states(tuple(plan.balance))
    orders = stage_orders(prediction.schedule, len(prediction.stages), prediction.chunks)
    ranks = tuple(
        on_rank(s, mine, whole, order) for s, (mine, whole), order in zip(prediction.stages, states, orders)
    )
    return replace(prediction, stages=ranks)


def _depth_first_peak(
    profile: ModelProfile,
    balance: Sequence[int],
    modes: Sequence[CheckpointMode],
    *,
    chunks: int,
    optimizer: Union[str, torch.optim.Optimizer, type],
    accumulating: bool,
    stale_grads: bool,
) -> int:
    plan = with_balance(_cpu_plan(balance), balance, modes)
    return predict_depth_first(
        profile, plan, chunks=chunks, optimizer=optimizer, accumulating=accumulating, stale_grads=stale_grads
    ).peak


def _search_shared(
    profile: ModelProfile,
    balance: Sequence[int],
    chunks: int,
    ranked: Sequence[CheckpointMode],
    per_mode: Mapping[str, Prediction],
    budget_bytes: int,
    stale_grads: bool = False,
    whole_of: Optional[Callable[[Sequence[CheckpointMode]], int]] = None,
) -> Tuple[Optional[Tuple[Tuple[CheckpointMode, ...], int]], Tuple[int, StageMemory]]:
    """Every combination of per-stage modes on one device, scored from per-stage terms: the fastest
    whose process peak fits (None if none does), and the least process peak with its deciding stage.
    ``whole_of``: the process peak of a combination, where the per-stage terms do not compose to it
    (a ``pipeline_of`` model, walked depth first)."""
    stages = len(balance)
    held = {m.name: held_per_step(profile, balance, (m,) * stages, chunks) for m in ranked}
    tail = gathered_gradient(profile, balance, chunks)

    def terms(j: int, m: CheckpointMode) -> Tuple[float, int, int]:
        s = per_mode[m.name].stages[j]
        return (s.time_s, held[m.name][j], s.peak - s.params - s.optimizer)

    # A mode no better than another on all three of its stage's terms can be dropped: the process
    # peak and the step time grow with each term, so the other does at least as well in any plan.
    options = []
    for j in range(stages):
        kept: List[CheckpointMode] = []
        for m in ranked:
            mine = terms(j, m)
            if not any(all(a <= b for a, b in zip(terms(j, o), mine)) for o in kept):
                kept = [o for o in kept if not all(a <= b for a, b in zip(mine, terms(j, o)))] + [m]
        options.append(kept)
    # Fastest first: the first combination that fits (and those as fast, for the least peak) is the
    # answer, so a search over many stages predicts only the combinations faster than it. ``least``
    # is exact where nothing fits (every combination was seen), the only case that reads it.
    options = [sorted(kept, key=lambda m: terms(j, m)) for j, kept in enumerate(options)]
    times = [[terms(j, m)[0] for m in kept] for j, kept in enumerate(options)]
    best: Optional[Tuple[float, int, Tuple[CheckpointMode, ...]]] = None
    least: Optional[Tuple[int, StageMemory]] = None
    for seen, (time_s, index) in enumerate(fastest_first(times)):
        if best is not None and time_s > best[0]:
            break
        if seen == MAX_COMBINATIONS:
            raise _too_many(math.prod(len(t) for t in times))
        picked = tuple(options[j][i] for j, i in enumerate(index))
        memories = [per_mode[m.name].stages[j] for j, m in enumerate(picked)]
        if whole_of is not None:
            whole = whole_of(picked)
        else:
            holds = [held[m.name][j] for j, m in enumerate(picked)]
            whole = compose(memories, holds, chunks, stale_grads, tail=tail)
        if least is None or whole < least[0]:
            least = (whole, max(memories, key=lambda s: s.peak - s.params - s.optimizer))
        if whole <= budget_bytes and (best is None or (time_s, whole) < best[:2]):
            best = (time_s, whole, picked)
    assert least is not None
    return (None if best is None else (best[2], best[1])), least


def _combinations(fits: Sequence[Sequence[CheckpointMode]]) -> List[Tuple[CheckpointMode, ...]]:
    count = math.prod(len(f) for f in fits)
    if count > MAX_COMBINATIONS:
        raise _too_many(count)
    return list(itertools.product(*fits))


def _too_many(count: int) -> Exception:
    return config_error(
        f"{count} per-stage mode combinations",
        f"choose predicts at most {MAX_COMBINATIONS} combinations of modes that do not nest",
        "pass fewer candidate modes, or fewer stages",
    )


#: The parts of a stage's peak, as :class:`~pipeckpt.memory.walk.StageMemory` names them.
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
