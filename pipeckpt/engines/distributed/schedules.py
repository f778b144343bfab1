"""The schedules of the installed ``torch.distributed.pipelining``, looked up by torch's own name table.

Names resolve through :func:`torch.distributed.pipelining.schedules.get_schedule_class` (any case,
underscores ignored), so a torch release that adds a schedule adds it here; what pipeckpt must know
beyond the class (stages per process, a split backward) is in :data:`_TRAITS`, and a schedule not
proven with pipeckpt is refused, naming why. A schedule is built for one micro-batch count and one
input shape (fixed receive buffers), so :class:`Schedules` keeps a few. Under a split backward each
stage's recompute Function splits its own backward (:mod:`pipeckpt.stages.weight_pass`), and the
stage's weight pass runs what its input pass left.
"""

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from pipeckpt._compat import live_op_order
from pipeckpt._errors import config_error
from pipeckpt.checkpointing.order import Op, gpipe_order, one_f_one_b_order
from pipeckpt.engines.distributed.boundaries import Boundaries
from pipeckpt.engines.distributed.wiring import LiveStage, StageModule
from pipeckpt.stages.weight_pass import WeightPass

__all__: List[str] = []

_KEPT = 4  # schedules kept per train/eval


@dataclass(frozen=True)
class _Traits:
    v_shape: bool = False  # stage j and stage 2 x pp - 1 - j on one process (exactly two each)
    split_backward: bool = False  # input and weight gradients in separate passes (zero bubble)
    min_microbatches_per_stage: bool = False  # at least as many micro-batches as stages


# What pipeckpt knows of each schedule class, proven by tests/engines/distributed/test_distributed_engine*.py.
_TRAITS: Dict[str, _Traits] = {
    "ScheduleGPipe": _Traits(),
    "Schedule1F1B": _Traits(min_microbatches_per_stage=True),
    "ScheduleInterleaved1F1B": _Traits(),
    "ScheduleLoopedBFS": _Traits(),
    "ScheduleInterleavedZeroBubble": _Traits(split_backward=True),
    "ScheduleZBVZeroBubble": _Traits(v_shape=True, split_backward=True),
    "ScheduleDualPipeV": _Traits(v_shape=True, split_backward=True, min_microbatches_per_stage=True),
}


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule, as the engine needs to know it."""

    name: str  # the user's spelling
    cls: Type[Any]
    traits: _Traits

    @property
    def looped(self) -> bool:
        """Whether a process may hold several stages."""
        return issubclass(self.cls, PipelineScheduleMulti)

    def stages_of(self, rank: int, pp: int, stages: int) -> List[int]:
        """The stage indices pipeline rank ``rank`` holds."""
        if self.traits.v_shape:
            return [rank, 2 * pp - 1 - rank]
        return [j for j in range(stages) if j % pp == rank]


def installed() -> List[str]:
    """The schedule names torch's ``get_schedule_class`` resolves in this installation."""
    names = []
    for attr in dir(torch_schedules):
        if attr.startswith("Schedule") and attr != "Schedule":
            try:
                get_schedule_class(attr[len("Schedule") :])
            except ValueError:
                continue
            names.append(attr[len("Schedule") :])
    return names


def lookup(name: str) -> ScheduleKind:
    """The schedule ``name`` names, or a config error listing the installed ones."""
    try:
        cls = get_schedule_class(str(name).replace("_", ""))
    except ValueError:
        cls = None
    if cls is None or not cls.__name__.startswith("Schedule"):
        raise config_error(
            f"schedule={name!r}",
            f"must name a schedule of torch.distributed.pipelining: one of {installed()}",
            "choose one of those (any case; underscores are ignored, e.g. 'interleaved_1f1b')",
        )
    traits = _TRAITS.get(cls.__name__)
    if traits is None:
        raise config_error(
            f"schedule={name!r}",
            f"pipeckpt has not been proven with {cls.__name__} (added by torch {torch.__version__})",
            f"use one of {[n[len('Schedule') :] for n in _TRAITS]}",
        )
    return ScheduleKind(name=str(name), cls=cls, traits=traits)


def microbatch_rule(kind: ScheduleKind, microbatches: int, pp: int, stages: int) -> Optional[str]:
    """Why ``microbatches`` do not fit ``kind`` on ``pp`` ranks holding ``stages`` stages, or None."""
    if kind.traits.min_microbatches_per_stage and microbatches < (stages if kind.looped else pp):
        need = stages if kind.looped else pp
        return (
            f"{kind.cls.__name__} needs at least as many micro-batches as pipeline stages ({need}); with "
            f"{microbatches} the schedule cannot fill its pipeline"
        )
    if kind.looped and not kind.traits.v_shape:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (
                f"{kind.cls.__name__} runs the micro-batches in rounds of pp={pp}, so their number "
                f"must be a multiple of {rounds} (micro-batches // pp)"
            )
    return None


class Schedules:
    """Schedules of one pipeline rank's stages, by (train, micro-batches, input shape)."""

    def __init__(
        self,
        *,
        kind: ScheduleKind,
        indices: Sequence[int],
        modules: Sequence[StageModule],
        trained: Sequence[nn.Module],
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        loss_fn: Callable[[Any, Tensor], Tensor],
        reduce_every: bool = False,
    ) -> None:
        self.kind = kind
        self._reduce_every = reduce_every
        self._indices, self._modules, self._trained = list(indices), list(modules), list(trained)
        self._num_stages, self._device, self._group = num_stages, device, group
        self._loss_fn = loss_fn
        for module in self._modules:
            module.no_views = kind.traits.split_backward
        self._cache: OrderedDict[Tuple[Any, ...], Tuple[Any, List[LiveStage]]] = OrderedDict()
        self._orders: weakref.WeakKeyDictionary[Any, Tuple[int, Dict[int, List[Op]]]]
        self._orders = weakref.WeakKeyDictionary()  # schedule -> (micro-batches, its orders)
        self._ends: weakref.WeakKeyDictionary[Any, Tuple[Optional[LiveStage], bool]]
        self._ends = weakref.WeakKeyDictionary()  # schedule -> (this process's last stage, a first?)

    def get(
        self, *, train: bool, microbatches: int, signature: Tuple[Any, ...]
    ) -> Tuple[Any, List[LiveStage]]:
        key = (train, microbatches, signature)
        schedule: Any
        if key in self._cache:
            self._cache.move_to_end(key)
            schedule, stages = self._cache[key]
            self._point(stages)
            return schedule, stages
        # Training runs the DDP-wrapped modules; forward-only runs need no gradient reduction.
        submodules = self._trained if train else self._modules
        boundaries = Boundaries()  # what crosses this schedule's stage boundaries, learnt at its first step
        stages = [
            LiveStage(m, s, j, self._num_stages, self._device, self._group, boundaries)
            for j, m, s in zip(self._indices, self._modules, submodules)
        ]
        for stage in stages:
            stage.reduce_every = self._reduce_every
        if train and self.kind.traits.split_backward:
            for stage in stages:
                _split(stage)
        self._point(stages)
        options: Dict[str, Any] = dict(
            n_microbatches=microbatches, scale_grads=False, loss_fn=self._loss_fn if train else None
        )
        if self.kind.looped:
            schedule = self.kind.cls(stages, **options)
        elif train:
            schedule = self.kind.cls(stages[0], **options)
        else:  # forward-only single-stage runs are fill-drain whatever the schedule
            schedule = torch_schedules.ScheduleGPipe(stages[0], **options)
        self._cache[key] = (schedule, stages)
        same_kind = [k for k in self._cache if k[0] == train]
        if len(same_kind) > _KEPT:
            del self._cache[same_kind[0]]
        return schedule, stages

    def _point(self, stages: Sequence[LiveStage]) -> None:
        """The stage modules (shared by every schedule) flatten and rebuild as ``stages``' schedule does."""
        for stage in stages:
            stage.stage_module.boundaries = stage.boundaries
            stage.stage_module.stage.weight_passes = _WEIGHT_PASSES.get(id(stage))

    def ends(self, schedule: Any, stages: Sequence[LiveStage]) -> Tuple[Optional[LiveStage], bool]:
        """``schedule``'s last stage among this process's ``stages`` (None: it holds none), and
        whether it holds the first: found once per schedule, not every step."""
        found = self._ends.get(schedule)
        if found is None:
            found = self._ends[schedule] = (
                next((s for s in stages if s.is_last), None),
                any(s.is_first for s in stages),
            )
        return found

    def orders(self, schedule: Any, microbatches: int) -> Dict[int, List[Op]]:
        """For each of this process's stages, the ops its device runs in one training step, in
        order (see :mod:`pipeckpt.checkpointing.order`): a looped schedule's own ``pipeline_order`` for this
        rank; derived for the single-stage ones, whose ``_step_microbatches`` torch codes apart
        from their (IR-only) ``pipeline_order``. Found once per schedule (a schedule's order is fixed
        when it is built); the lists are shared, not to be changed."""
        found = self._orders.get(schedule)
        if found is None or found[0] != microbatches:
            found = self._orders[schedule] = (microbatches, self._orders_of(schedule, microbatches))
        return found[1]

    def _orders_of(self, schedule: Any, microbatches: int) -> Dict[int, List[Op]]:
        if self.kind.looped:
            # A split backward recomputes in its input pass: that is the backward the stage sees.
            ops = live_op_order(schedule)
            mine = [(j, "B" if kind == "I" else kind, i) for j, kind, i in ops if kind != "W"]
            return {j: mine for j in self._indices}
        (j,) = self._indices
        if self.kind.cls.__name__ == "Schedule1F1B":
            return {j: one_f_one_b_order(j, self._num_stages, microbatches)}
        assert self.kind.cls.__name__ == "ScheduleGPipe", f"no op order known for {self.kind.cls.__name__}"
        return {j: gpipe_order(j, microbatches)}

    def clear(self) -> None:
        self._cache.clear()
        self._orders.clear()
        self._ends.clear()


# A split schedule's stage -> where its Stage leaves the weight passes while that schedule runs (by
# id: torch's PipelineStage is not hashable by value); Schedules._point hands the list to the Stage.
_WEIGHT_PASSES: Dict[int, List[WeightPass]] = {}


def _split(stage: LiveStage) -> None:
    """Each micro-batch's input pass on ``stage`` leaves its weight gradients to the weight pass the
    schedule runs later. Not under selective checkpointing (torch's checkpoint gives up the outputs
    it kept at its one recompute, so no second backward can cross the region). No stage of a split
    schedule is DDP-wrapped: its replicas average after the step (building.py
    ``_averaged_after_step``; torch's input passes never arm DDP's reducer)."""
    if stage.stage_module.stage.mode.selective:
        return
    passes: List[WeightPass] = []
    _WEIGHT_PASSES[id(stage)] = passes
    weakref.finalize(stage, _WEIGHT_PASSES.pop, id(stage), None)

    def weight_pass() -> Callable[[], None]:  # torch calls it after each input pass (its dw_builder)
        ready = list(passes)
        passes.clear()
        return lambda: _run(ready)

    stage.dw_builder = weight_pass


def _run(ready: List[WeightPass]) -> None:
    while ready:
        ready.pop(0)()
