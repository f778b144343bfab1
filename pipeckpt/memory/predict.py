"""The memory model's answer: each stage's predicted peak and time under a plan and a schedule,
and one device's peak where it runs several stages.

Why a prediction and not a measurement: a user choosing checkpoint modes, chunks and a balance
faces modes^stages x chunks x balances combinations, and measuring each costs a training step on
the real devices; a profile of one micro-batch (:mod:`pipeckpt.memory.profile`) fixes the rules
memory follows, and each prediction is a walk over op orders (:mod:`pipeckpt.memory.walk`).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from pipeckpt._errors import config_error
from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.checkpointing.order import kept as kept_microbatches
from pipeckpt.memory.profile import ModelProfile
from pipeckpt.memory.schedule import op_order, sends_held, split_backward
from pipeckpt.memory.sharding import RankState
from pipeckpt.memory.stage_memory import StageMemory, _Peak
from pipeckpt.memory.stage_model import stage_model
from pipeckpt.memory.walk import _op_times, _predict_stage, _result, _StageWalk
from pipeckpt.stages.partition import StagePlan

__all__ = ["Prediction", "DeviceMemory", "predict", "predict_device", "predict_depth_first", "with_balance"]


@dataclass(frozen=True)
class Prediction:
    """Every stage's predicted memory and time under one schedule."""

    stages: Tuple[StageMemory, ...]
    step_time_s: float  # the schedule's makespan on one device per stage (or the sum, shared)
    schedule: str
    order_source: str
    chunks: int

    @property
    def peak(self) -> int:
        return max(s.peak for s in self.stages)


@dataclass(frozen=True)
class DeviceMemory:
    """One device's predicted peak (bytes) where it runs several stages (a looped schedule)."""

    stages: Tuple[StageMemory, ...]  # each stage's own walk, as if alone on the device
    params: int
    optimizer: int
    peak: int  # everything the device's stages hold at its worst op
    peak_at: str  # e.g. "stage 2 B3 layer 5"


def predict(
    profile: ModelProfile,
    plan: StagePlan,
    *,
    chunks: int,
    optimizer: Union[str, torch.optim.Optimizer, type] = "adam",
    schedule: str = "local",
    accumulating: bool = False,
    shared_device: bool = False,
    stale_grads: bool = False,
) -> Prediction:
    """Per-stage memory and step time of ``plan`` with ``chunks`` micro-batches of the profiled
    size: each stage walks its op order (:mod:`pipeckpt.memory.walk`).

    Args:
        profile: one micro-batch of the Sequential that ``plan`` cuts
            (:func:`~pipeckpt.memory.profile.profile`).
        plan: the balance and a checkpoint mode per stage.
        chunks: micro-batches per step.
        optimizer: whose state to count (:func:`~pipeckpt.memory.optimizer_state.optimizer_state_bytes`).
        schedule: ``local``, ``gpipe`` or ``1f1b`` (:data:`~pipeckpt.memory.schedule.SCHEDULES`).
        accumulating: ``.grad`` already holds gradients when the step starts (gradient
            accumulation), so they count from the first op.
        shared_device: every stage runs on one device (the local engine on CPU), so the step time
            is the sum of the stages' times.
        stale_grads: the previous step's gradients stay until the first backward starts (a
            Trainer zeroes them after ``training_step``), so they count through the forwards.
    """
    _check_balance(profile, plan)
    stages = plan.stages
    order, source = op_order(schedule, stages=stages, microbatches=chunks)
    local = schedule == "local"
    out, times = [], []
    for j, ((start, stop), mode) in enumerate(zip(plan.ranges, plan.modes)):
        model = stage_model(profile, start, stop, first=j == 0, last=j == stages - 1, local=local)
        keep = kept_microbatches([(j, kind, i) for kind, i in order[j]], j)
        out.append(
            _predict_stage(
                model,
                j,
                mode,
                order[j],
                chunks=chunks,
                keep=keep,
                optimizer=optimizer,
                accumulating=accumulating,
                sends=sends_held(schedule, order[j], stages=stages, stage=j),
                stale_grads=stale_grads,
            )
        )
        times.append(_op_times(model, mode, chunks, keep))
    step = sum(s.time_s for s in out) if shared_device else _makespan(order, times, local=local)
    return Prediction(
        stages=tuple(out), step_time_s=step, schedule=schedule, order_source=source, chunks=chunks
    )


def predict_device(
    profile: ModelProfile,
    plan: StagePlan,
    *,
    chunks: int,
    order: Sequence[Tuple[int, str, int]],
    optimizer: Union[str, torch.optim.Optimizer, type] = "adam",
    accumulating: bool = False,
    states: Optional[Sequence[Tuple[RankState, RankState]]] = None,
) -> DeviceMemory:
    """The peak of one device that runs several stages of ``plan`` under a looped torch schedule
    (``interleaved_1f1b``, ``looped_bfs``). While one stage runs an op, the device's other stages
    hold what they hold between ops (parameters, optimizer state, gradients once made, receive
    buffers, their micro-batches in flight) and what their sends still reference: measured on
    gloo, every output and input gradient a looped schedule sends (in batches that mix sends and
    receives) stays alive until the step ends, as under GPipe. ``except_last`` keeps what
    :func:`pipeckpt.checkpointing.order.kept` reads off the device's order, as the stages do.

    Args:
        profile: one micro-batch of the Sequential that ``plan`` cuts.
        plan: the balance and a checkpoint mode per stage (every stage of the pipeline).
        chunks: micro-batches per step.
        order: the device's ops ``(stage, "F" | "B" | "I" | "W", micro-batch)`` as the schedule runs them (its
            own ``pipeline_order`` for this rank: :func:`pipeckpt._compat.live_op_order`).
        optimizer: whose state to count.
        accumulating: ``.grad`` already holds gradients when the step starts.
        states: each stage's state on one of its ranks and unsharded
            (:func:`~pipeckpt.memory.sharding.stage_rank_states`), where the device is one rank of
            a sharded layout (FSDP, TP): each stage's walk then holds the rank's shares
            (:func:`_on_rank`). None: each stage's state whole.
    """
    _check_balance(profile, plan)
    unknown = sorted({kind for _, kind, _ in order} - {"F", "B", "I", "W"})
    if unknown:
        raise config_error(
            f"an op order with {unknown} ops",
            "the model knows forwards (F), whole backwards (B) and split ones (I, then W)",
            "predict from a schedule's own compute actions (pipeckpt._compat.live_op_order)",
        )
    ops, split = split_backward(order)
    walks: Dict[int, _StageWalk] = {}
    for j in sorted({j for j, _, _ in ops}):
        start, stop = plan.ranges[j]
        model = stage_model(profile, start, stop, first=j == 0, last=j == plan.stages - 1, local=False)
        walks[j] = _StageWalk(
            model,
            j,
            plan.modes[j],
            chunks=chunks,
            keep=kept_microbatches(ops, j),
            optimizer=optimizer,
            accumulating=accumulating,
        )
        walks[j].hold_sends = True
        walks[j].split = {i for k, i in split if k == j}
        if states is not None:
            _on_rank(walks[j], *states[j])
    device = _Peak()
    for j, kind, i in ops:
        around = sum(w.resting() for k, w in walks.items() if k != j)
        walks[j].run(kind, i, device=device, around=around)
    stages = tuple(_result(w) for w in walks.values())
    return DeviceMemory(
        stages=stages,
        params=sum(st.params for st in stages),
        optimizer=sum(st.optimizer for st in stages),
        peak=device.value,
        peak_at=device.at,
    )


def _on_rank(walk: _StageWalk, state: RankState, whole: RankState) -> None:
    """``walk``'s stage state replaced, in place, by one rank's shares, as
    :func:`pipeckpt.memory.rank_peak.on_rank` replaces a single stage's (what the walk counts
    beyond the sharded layers, a ``pipeline_of`` model's own parameters, stays whole). A looped
    rank holds every one of its stages' states all step, and its gathered parameters and
    collective buffers are counted held all step too: exact without ``reshard_after_forward``
    (torchtitan's default under PP, where a stage's units stay gathered once its first forward
    ran), an upper bound with it. Its gradients are whole until the step reduces them
    (``grads_backward``), or the shards where each micro-batch reduces its own; the walk counts a
    layer's gradient as the whole layer's (a tensor-parallel profile keeps the whole layers'
    parameter figures), so each is scaled to the rank's share."""
    s = walk.s
    extra = s.param_bytes + s.frozen_bytes - whole.params
    grads = state.grads if state.grads_backward is None else state.grads_backward
    gathered = max(state.unsharded, state.unsharded_backward or 0)
    walk.opt = state.optimizer + walk.opt - whole.optimizer
    walk.params = state.params + extra + gathered  # as rank_peak.on_rank counts a rank's
    walk.static = walk.params + walk.opt + state.collectives
    walk.grads = grads + s.param_bytes - whole.grads
    walk.grad_share = grads / whole.grads if whole.grads else 1.0


def predict_depth_first(
    profile: ModelProfile,
    plan: StagePlan,
    *,
    chunks: int,
    optimizer: Union[str, torch.optim.Optimizer, type] = "adam",
    accumulating: bool = False,
    stale_grads: bool = False,
) -> DeviceMemory:
    """The one device's peak of a ``pipeline_of`` model under the local engine, every stage on it:
    its ``forward`` runs once per micro-batch (engines/local/module.py), so micro-batch ``i`` goes
    through every stage before ``i + 1`` starts, and backward runs micro-batch by micro-batch from
    the last, each from the last stage to the first. While one stage runs an op, the others hold
    what they hold between ops. Arguments as :func:`predict`'s.

    Args:
        profile: one micro-batch of the model (:func:`~pipeckpt.memory.profile.profile`).
        plan: the balance and a checkpoint mode per stage.
        chunks: micro-batches per step.
        optimizer: whose state to count.
        accumulating: ``.grad`` already holds gradients when the step starts.
        stale_grads: the previous step's gradients stay until the first backward starts.
    """
    _check_balance(profile, plan)
    stages = plan.stages
    order, _ = op_order("local", stages=stages, microbatches=chunks)
    walks = []
    for j, ((start, stop), mode) in enumerate(zip(plan.ranges, plan.modes)):
        model = stage_model(profile, start, stop, first=j == 0, last=j == stages - 1, local=True)
        keep = kept_microbatches([(j, kind, i) for kind, i in order[j]], j)
        walks.append(
            _StageWalk(
                model,
                j,
                mode,
                chunks=chunks,
                keep=keep,
                optimizer=optimizer,
                accumulating=accumulating,
                stale_grads=stale_grads,
            )
        )
    forwards = [(j, "F", i) for i in range(chunks) for j in range(stages)]
    backwards = [(j, "B", i) for i in reversed(range(chunks)) for j in reversed(range(stages))]
    device = _Peak()
    for n, (j, kind, i) in enumerate([*forwards, *backwards]):
        if n == len(forwards):  # the Trainer zeroes every stage's gradients before backward starts
            for w in walks:
                w.grads_done = w.grads_done and not w.stale
                w.stale = False
        around = sum(w.resting() for k, w in enumerate(walks) if k != j)
        walks[j].run(kind, i, device=device, around=around)
    for j, w in enumerate(walks):  # the step goes parameter by parameter: one's temporaries at a time
        w.step(device=device, around=sum(o.resting() for k, o in enumerate(walks) if k != j))
    results = tuple(_result(w) for w in walks)
    return DeviceMemory(
        stages=results,
        params=sum(st.params for st in results),
        optimizer=sum(st.optimizer for st in results),
        peak=device.value,
        peak_at=device.at,
    )


def _makespan(
    order: List[List[Tuple[str, int]]], times: List[Dict[Tuple[str, int], float]], *, local: bool
) -> float:
    """The step's length with one device per stage: each stage runs its ops in order, a forward
    after the previous stage's forward of that micro-batch, a backward after the next stage's
    backward (the last stage's after its own forward, and under the local engine after every
    forward: one backward pass over the gathered batch)."""
    stages = len(order)
    end: Dict[Tuple[str, int, int], float] = {}
    position = [0] * stages
    clock = [0.0] * stages
    last_forwards = [("F", stages - 1, i) for k, i in order[-1] if k == "F"]
    while any(position[j] < len(order[j]) for j in range(stages)):
        progressed = False
        for j in range(stages):
            if position[j] >= len(order[j]):
                continue
            kind, i = order[j][position[j]]
            if kind == "F":
                deps = [("F", j - 1, i)] if j > 0 else []
            elif j < stages - 1:
                deps = [("B", j + 1, i)]
            else:
                deps = list(last_forwards) if local else [("F", j, i)]
            if any(d not in end for d in deps):
                continue
            start = max([clock[j], *(end[d] for d in deps)])
            clock[j] = start + times[j][(kind, i)]
            end[(kind, j, i)] = clock[j]
            position[j] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"op orders deadlock: {order}")
    return max(clock) if clock else 0.0


def with_balance(plan: StagePlan, balance: Sequence[int], modes: Sequence[CheckpointMode]) -> StagePlan:
    """``plan`` cut by another balance with other modes, on its devices (or its first device for
    every stage where the stage count changes).

    Args:
        plan: the plan whose devices to keep.
        balance: layers per stage.
        modes: a checkpoint mode per stage.
    """
    devices = plan.devices if len(plan.devices) == len(balance) else (plan.devices[0],) * len(balance)
    return StagePlan(balance=tuple(balance), devices=tuple(devices), modes=tuple(modes))


def _check_balance(profile: ModelProfile, plan: StagePlan) -> None:
    if sum(plan.balance) != len(profile.layers):
        raise config_error(
            f"balance {list(plan.balance)} (sum {sum(plan.balance)})",
            f"the profile has {len(profile.layers)} layers",
            "profile the same Sequential the plan cuts",
        )
