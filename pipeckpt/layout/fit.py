"""Whether a layout fits its devices, and with which checkpoint modes: the search's memory function.

Why a function of its own: the search asks it of thousands of layouts, so it answers in two steps
of rising cost. :meth:`Memory.state_bytes` reads parameter shapes only (one rank's share of the
parameters, gradients and optimizer state, :func:`pipeckpt.memory.sharding.rank_state`): a layout
whose state alone exceeds the device is gone before anything is profiled. :meth:`Memory.fit` then
profiles one micro-batch, once per distinct tensor-parallel share and micro-batch size (every layout
with that shape reuses it), and lets :func:`pipeckpt.memory.auto.choose` pick each stage's mode
under the device's memory with the per-rank states of :func:`~pipeckpt.memory.sharding.stage_rank_states`;
layouts that differ only in their data-parallel replicas share one answer.

A looped schedule's rank holds ``virtual_stages`` stages: each is planned as a stage of a 1F1B
pipeline of ``pp x virtual_stages`` stages (GPipe's for looped BFS) within an equal share of the
device; the rank's peak is its stages walked together along its own op order, each holding the
rank's share of its state (docs/LAYOUT.md).
"""

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from pipeckpt._errors import PipeckptConfigError, config_error
from pipeckpt.checkpointing.modes import NEVER, CheckpointMode, parse_modes
from pipeckpt.engines.distributed.schedules import lookup
from pipeckpt.layout.candidates import Candidate
from pipeckpt.layout.orders import rank_orders
from pipeckpt.memory.auto import DEFAULT_MODES, choose, with_balance_modes
from pipeckpt.memory.outside_share import OutsideParam
from pipeckpt.memory.predict import Prediction, predict, predict_device, with_balance
from pipeckpt.memory.profile import ModelProfile
from pipeckpt.memory.rank_peak import on_rank, stage_orders
from pipeckpt.memory.sharding import Layout, RankState, stage_rank_states
from pipeckpt.memory.vocab_share import split_over_vocabulary
from pipeckpt.sizes import human
from pipeckpt.stages.partition import StagePlan, min_max_partition

__all__ = ["Fitted", "Shapes", "Memory", "memory_schedule", "balance_of", "EXACT_STAGES"]

#: Up to this many stages every combination of modes is scored (7 modes: 343 plans); beyond, each
#: stage takes its fastest mode that fits.
EXACT_STAGES = 3

#: The model's layers as one tensor-parallel rank computes them, and the plan that splits them
#: (empty: already one rank's share), by tensor-parallel degree.
LayersOf = Callable[[int], Tuple[nn.Sequential, Tuple[Tuple[str, str], ...]]]
#: One micro-batch's profile, by tensor-parallel degree, micro-batch size (samples) and whether the
#: sequence is split too (sequence parallelism, under tp > 1 only).
ProfileOf = Callable[[int, int, bool], ModelProfile]


@dataclass(frozen=True)
class Shapes:
    """What the memory function reads of a model: its layers and profiles, by tensor-parallel degree."""

    layers: LayersOf
    profile: ProfileOf


@dataclass(frozen=True)
class Fitted:
    """A layout that fits: its modes chosen, the stages' balance, each pipeline rank's predicted peak."""

    candidate: Candidate
    balance: Tuple[int, ...]
    peaks: Tuple[int, ...]  # bytes, one per pipeline rank
    prediction: Prediction  # the memory model's, per stage (times from the profile)

    @property
    def peak(self) -> int:
        return max(self.peaks)


#: The uniform modes a looped layout falls back to, in the order of what they recompute (``selective``
#: the cheap ops of every micro-batch, ``except_last`` every op of all but one, ``always`` every op
#: of every one): the first that fits is taken, the fastest of them wherever the recompute each
#: adds orders their steps so (``selective`` against ``except_last`` is not proven).
WALKED = ("never", "selective", "except_last", "always")


def memory_schedule(schedule: str) -> str:
    """The schedule the memory model predicts for ``schedule``'s stages: its own for GPipe and 1F1B;
    GPipe's for looped BFS (all forwards first), 1F1B's for the other looped ones."""
    kind = lookup(schedule)
    if kind.cls.__name__ in ("ScheduleGPipe", "ScheduleLoopedBFS"):
        return "gpipe"
    return "1f1b"


def balance_of(sequential: nn.Sequential, stages: int) -> Tuple[int, ...]:
    """The engine's default balance (``balance_by='params'``): layers per stage by parameter count."""
    costs = [1 + sum(p.numel() for p in layer.parameters()) for layer in sequential]
    return min_max_partition(costs, stages)


class Memory:
    """The search's memory function for one model on one kind of device.

    Args:
        shapes: the model's layers and profiles.
        device_bytes: one device's memory.
        global_batch: samples per optimizer step, over every replica.
        precision: Lightning's precision name (compute and master dtypes).
        optimizer: whose state to count.
        modes: the checkpoint modes ``choose`` may give a stage.
        gloo: the ranks reduce over gloo (``cluster=local``): its reduce-scatter's staging copy is
            counted (:class:`~pipeckpt.memory.sharding.Layout`).
    """

    def __init__(
        self,
        shapes: Shapes,
        *,
        device_bytes: int,
        global_batch: int,
        precision: str = "32-true",
        optimizer: Union[str, torch.optim.Optimizer, type] = "adamw",
        modes: Sequence[object] = DEFAULT_MODES,
        gloo: bool = False,
    ) -> None:
        self.shapes, self.device_bytes, self.global_batch = shapes, device_bytes, global_batch
        self.gloo = gloo  # the ranks reduce over gloo (cluster=local): Layout.gloo
        self.precision, self.optimizer, self.modes = precision, optimizer, list(modes)
        self._built: Dict[int, Tuple[nn.Sequential, Tuple[Tuple[str, str], ...]]] = {}
        self._profiles: Dict[Tuple[int, int, bool], ModelProfile] = {}
        self._states: Dict[Tuple[object, ...], int] = {}
        self._answers: Dict[Tuple[object, ...], Tuple[Tuple[str, ...], Tuple[int, ...], Prediction]] = {}
        self._balances: Dict[Tuple[int, int], Tuple[int, ...]] = {}
        self._rank_state_fns: Dict[Tuple[object, ...], Callable[[Tuple[int, ...]], Sequence[Any]]] = {}
        self._looped: Dict[Tuple[object, ...], Tuple[int, ...]] = {}

    def _layers(self, tp: int) -> Tuple[nn.Sequential, Tuple[Tuple[str, str], ...]]:
        if tp not in self._built:
            self._built[tp] = self.shapes.layers(tp)
        return self._built[tp]

    def layout(self, c: Candidate) -> Layout:
        """How ``c`` spreads a stage's parameters over ranks, as the memory model reads it."""
        _, plan = self._layers(c.tp)
        return Layout(
            fsdp=c.dp_shard,
            tp=c.tp,
            precision=self.precision,
            tp_plan=plan,
            reshard_after_forward=c.reshard,
            reduce_every_microbatch=c.reduce_every,
            sequence_parallel=c.tp > 1 and c.sequence,
            gloo=self.gloo,
        )

    def state_bytes(self, c: Candidate) -> int:
        """The largest pipeline rank's share of parameters, gradients and optimizer state under ``c``
        (parameters outside the layers not counted: a lower bound, safe to prune by)."""
        kind = lookup(c.schedule)
        key = (c.tp, c.dp_shard, c.pp, c.stages, kind.traits.v_shape, c.reshard, c.balance)
        if key not in self._states:
            balance = self._balance(c)
            states = self._rank_states(c, None)(balance)
            per_rank = []
            for r in range(c.pp):
                held = [states[j][0] for j in kind.stages_of(r, c.pp, c.stages)]
                per_rank.append(sum(s.params + s.grads + s.optimizer for s in held))
            self._states[key] = max(per_rank)
        return self._states[key]

    def _balance(self, c: Candidate) -> Tuple[int, ...]:
        """``c``'s layers per stage: its own cut (by time), else the engine's default, once per
        tensor-parallel degree and stage count (it reads every parameter: a quarter of a 126-layer
        model's search, asked per layout)."""
        if c.balance:
            return c.balance
        key = (c.tp, c.stages)
        if key not in self._balances:
            self._balances[key] = balance_of(self._layers(c.tp)[0], c.stages)
        return self._balances[key]

    def _rank_states(
        self, c: Candidate, outside: Optional[Tuple[OutsideParam, ...]]
    ) -> Callable[[Tuple[int, ...]], Sequence[Tuple[RankState, RankState]]]:
        """Each stage's state on one of its ranks, per balance, for ``c``'s sharding: one function (it
        caches by balance) for every layout sharded alike, whatever its micro-batches and schedule;
        made anew for each, the per-rank states were most of a 512-GPU search's time."""
        key = (c.tp, c.sequence, c.dp_shard, c.reshard, c.reduce_every, outside)
        if key not in self._rank_state_fns:
            sequential, _ = self._layers(c.tp)
            self._rank_state_fns[key] = stage_rank_states(
                sequential,
                self.layout(c),
                self.optimizer,  # type: ignore[arg-type]
                outside,
            )
        return self._rank_state_fns[key]

    def profile(self, tp: int, microbatch: int, sequence: bool = False) -> ModelProfile:
        """One micro-batch of ``microbatch`` samples on one tensor-parallel rank's layers, profiled once
        (``sequence``: its part of the sequence too, under tp > 1); the logits of a head the plan
        splits over the vocabulary counted as one rank holds them."""
        key = (tp, microbatch, sequence and tp > 1)
        if key not in self._profiles:
            _, plan = self._layers(tp)  # a head the plan splits: one rank's share of its logits
            self._profiles[key] = split_over_vocabulary(self.shapes.profile(*key), tp, plan)
        return self._profiles[key]

    @property
    def profiled(self) -> List[Tuple[int, int, bool]]:
        """The ``(tp, micro-batch size, sequence split)`` shapes profiled so far."""
        return list(self._profiles)

    def fit(self, c: Candidate) -> Fitted:
        """``c`` with each stage's mode chosen under the device's memory, and each rank's peak.
        Raises :class:`~pipeckpt.PipeckptConfigError` (choose's, naming the smallest budget that
        would fit) where no modes do. A layout given with its modes (by hand) keeps them: its peak
        is predicted, fit or not. A looped layout's stages are each chosen as a stage of a 1F1B
        pipeline in an equal share of the device, which can find no modes, or modes whose stages
        walked together do not fit, where the same mode on every stage fits walked: then the first
        of :data:`WALKED` that fits (torchtitan's 405B interleaved layout under sequence
        parallelism: none found in half the device; 71.3 GiB walked with ``always``)."""
        if c.modes or c.virtual_stages == 1:
            return self._fit(c)
        try:
            chosen = self._fit(c)
        except PipeckptConfigError:
            if (walked := self._walked(c)) is not None:
                return walked
            raise
        if chosen.peak > self.device_bytes:
            return self._walked(c) or chosen
        return chosen

    def _walked(self, c: Candidate) -> Optional[Fitted]:
        """``c`` (looped) with the first mode of :data:`WALKED` among the search's modes whose every
        stage holding it fits the device, its stages walked together; None where none does."""
        names = {parse_modes([m], 1)[0].name for m in self.modes}  # type: ignore[list-item]
        for name in (n for n in WALKED if n in names):
            if (fitted := self._fit(replace(c, modes=(name,)))).peak <= self.device_bytes:
                return fitted
        return None

    def _fit(self, c: Candidate) -> Fitted:
        microbatch = self.global_batch // c.dp // c.chunks
        schedule = memory_schedule(c.schedule)
        budget = self.device_bytes // c.virtual_stages
        shape = (c.tp, c.sequence, c.dp_shard, microbatch, c.stages, c.chunks, schedule, budget)
        key = (*shape, c.reshard, c.reduce_every, self._balance(c))
        if c.modes:  # given (one for every stage, or one each): predicted, not chosen
            if (key, c.modes) not in self._answers:  # layouts alike but for their replicas: once
                fitted, states, balance = self._inputs(c, microbatch)
                given = parse_modes(c.modes[0] if len(c.modes) == 1 else list(c.modes), len(balance))
                prediction = self._predicted(fitted, balance, c.chunks, schedule, states, given)
                self._answers[(key, c.modes)] = (tuple(m.name for m in given), balance, prediction)
            answer = self._answers[(key, c.modes)]
        else:
            if key not in self._answers:
                fitted, states, balance = self._inputs(c, microbatch)
                self._answers[key] = self._choose(fitted, budget, balance, c.chunks, schedule, states)
            answer = self._answers[key]
        names, balance, prediction = answer
        kind = lookup(c.schedule)
        if c.virtual_stages > 1:  # layouts that differ in their replicas only walk alike
            looped = (key, c.schedule, c.pp, c.virtual_stages, names)
            if looped not in self._looped:
                self._looped[looped] = self._looped_peaks(c, microbatch, names, balance)
            peaks = self._looped[looped]
        else:
            peaks = tuple(
                sum(prediction.stages[j].peak for j in kind.stages_of(r, c.pp, c.stages)) for r in range(c.pp)
            )
        return Fitted(replace(c, modes=names), balance, peaks, prediction)

    def _inputs(
        self, c: Candidate, microbatch: int
    ) -> Tuple[
        ModelProfile, Callable[[Tuple[int, ...]], Sequence[Tuple[RankState, RankState]]], Tuple[int, ...]
    ]:
        """What a prediction of ``c`` starts from: the micro-batch's profile, the per-rank states of
        ``c``'s sharding, and the engine's balance of its stages."""
        fitted = self.profile(c.tp, microbatch, c.sequence)
        return fitted, self._rank_states(c, fitted.outside_params), self._balance(c)

    def _looped_peaks(
        self, c: Candidate, microbatch: int, names: Sequence[str], balance: Tuple[int, ...]
    ) -> Tuple[int, ...]:
        """Each rank's peak under a looped schedule, its stages walked together along the rank's
        own op order (:func:`~pipeckpt.memory.predict.predict_device`): a zero-bubble rank holds a
        micro-batch's activations until its weight pass, which no stage of a 1F1B pipeline does.
        Each stage's state is the rank's share of it (FSDP's shards, TP's split, replicas whole)."""
        plan = StagePlan(
            balance, (torch.device("cpu"),) * len(balance), tuple(parse_modes(list(names), len(names)))
        )
        fitted = self.profile(c.tp, microbatch, c.sequence)
        states = self._rank_states(c, fitted.outside_params)(balance)
        return tuple(
            predict_device(
                fitted, plan, chunks=c.chunks, order=order, optimizer=self.optimizer, states=states
            ).peak
            for order in rank_orders(c.schedule, c.pp, c.virtual_stages, c.chunks)
        )

    def _choose(
        self,
        fitted: ModelProfile,
        budget: int,
        balance: Tuple[int, ...],
        chunks: int,
        schedule: str,
        states: Callable[[Tuple[int, ...]], Sequence[Tuple[RankState, RankState]]],
    ) -> Tuple[Tuple[str, ...], Tuple[int, ...], Prediction]:
        """The modes, balance and prediction: ``never`` everywhere where it fits (nothing is
        recomputed, so no plan is faster: the makespan grows with every op's time); else
        :func:`~pipeckpt.memory.auto.choose` over every combination up to :data:`EXACT_STAGES`
        stages, and per stage the fastest mode that fits beyond (each stage's memory depends on its
        own mode only, so the plan fits; the makespan is not proven least)."""
        options = dict(chunks=chunks, optimizer=self.optimizer, schedule=schedule, rank_states=states)
        try:
            picked = choose(fitted, budget, balance=balance, modes=[NEVER], **options)  # type: ignore[arg-type]
        except PipeckptConfigError:
            if len(balance) > EXACT_STAGES:
                candidates = [parse_modes([m], 1)[0] for m in self.modes]  # type: ignore[list-item]
                predicted = functools.partial(self._predicted, fitted, balance, chunks, schedule, states)
                names, prediction = fastest_per_stage(predicted, candidates, budget, len(balance))
                return names, balance, prediction
            picked = choose(fitted, budget, balance=balance, modes=self.modes, **options)  # type: ignore[arg-type]
        return tuple(m.name for m in picked.modes), picked.balance, picked.prediction

    def _predicted(
        self,
        fitted: ModelProfile,
        balance: Tuple[int, ...],
        chunks: int,
        schedule: str,
        states: Callable[[Tuple[int, ...]], Sequence[Tuple[RankState, RankState]]],
        modes: Sequence[CheckpointMode],
    ) -> Prediction:
        """The prediction of ``modes`` (one per stage), each stage on one of its ranks."""
        plan = with_balance(with_balance_modes(balance, NEVER), balance, modes)
        p = predict(fitted, plan, chunks=chunks, optimizer=self.optimizer, schedule=schedule)
        orders = stage_orders(p.schedule, len(p.stages), p.chunks)
        ranks = tuple(
            on_rank(st, mine, whole, order)
            for st, (mine, whole), order in zip(p.stages, states(balance), orders)
        )
        return replace(p, stages=ranks)


def fastest_per_stage(
    predicted: Callable[[Sequence[CheckpointMode]], Prediction],
    modes: Sequence[CheckpointMode],
    budget: int,
    stages: int,
) -> Tuple[Tuple[str, ...], Prediction]:
    """Per stage the fastest of ``modes`` (then the least memory) whose peak fits ``budget``, from
    each mode's prediction on every stage (``predicted``): a stage's memory depends on its own mode
    only, so the plan fits; its makespan is not proven least. Raises where a stage fits in none."""
    uniform = [predicted([m] * stages) for m in modes]
    picked = []
    for j in range(stages):
        fits = [(u.stages[j].time_s, u.stages[j].peak, m) for m, u in zip(modes, uniform)]
        fits = [f for f in fits if f[1] <= budget]
        if not fits:
            least = min(u.stages[j].peak for u in uniform)
            raise config_error(
                f"memory budget {human(budget)}",
                f"no plan fits: stage {j} needs {human(least)} in its least-memory mode",
                "add devices or stages, or use a device with more memory",
            )
        picked.append(min(fits, key=lambda f: (f[0], f[1]))[2])
    return tuple(m.name for m in picked), predicted(picked)
