"""``checkpoint="auto"`` under the distributed engine: what a budgeted plan must respect here.

Why a module of its own: the choice is engine-free (:func:`pipeckpt.memory.budget.resolve_auto`), made
once, on global rank 0, and broadcast to every rank before any stage is built, because profiled
times differ between processes and ranks that each chose for themselves could build different
pipelines. What only this engine knows lives here: which of its schedules the memory model
covers, that the stage count must be fixed by the settings (the choice is made per stage, and
this engine's stages are its processes), which micro-batch counts the schedule accepts on the
topology, and how the engine takes in the chosen settings (resolved, and checked against the
topology it resolved from the configured ones before the plan existed).

The budget is per device, and here a device is a process: each stage's predicted peak is
compared with it on its own (``shared_device=False``).
"""

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence

from pipeckpt._errors import config_error
from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.engines.distributed.liveness import user_code
from pipeckpt.engines.distributed.schedules import check_modes, lookup, microbatch_rule
from pipeckpt.engines.distributed.topology import Topology, check_chunks
from pipeckpt.settings import PipeSettings

__all__ = ["AUTO_SCHEDULES", "same_on_every_rank", "check_auto", "model_schedule", "usable_chunks", "adopt"]

#: The distributed schedules ``checkpoint="auto"`` plans, by torch's class name, with the name the
#: memory model (:data:`pipeckpt.memory.schedule.SCHEDULES`) knows each by.
AUTO_SCHEDULES: Dict[str, str] = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b"}


@contextmanager
def same_on_every_rank() -> Iterator[None]:
    """Within (the choice, on rank 0): an error is the user's own, not a peer's failure. The
    strategy broadcasts it and every rank raises it, so each stops with the error itself (the
    smallest feasible budget, say), none with a stuck collective's diagnosis
    (:meth:`~pipeckpt.engines.distributed.engine.DistributedEngine.on_exception`). The mark
    travels with the error: a broadcast pickles its attributes."""
    with user_code():
        yield


def model_schedule(settings: PipeSettings) -> str:
    """The memory model's name of the settings' schedule; a config error when it has none."""
    s = settings.resolved()
    kind = lookup(s.schedule or "")
    name = AUTO_SCHEDULES.get(kind.cls.__name__)
    if name is None:
        raise config_error(
            f"checkpoint='auto' with schedule={s.schedule!r}",
            f"the memory model behind auto predicts the schedules {list(AUTO_SCHEDULES.values())} only",
            "set schedule='gpipe' or '1f1b', or choose the modes yourself (checkpoint=[...]; "
            "`python -m pipeckpt.plan` predicts each stage's peak for the modes you give)",
        )
    return name


def check_auto(settings: PipeSettings) -> None:
    """Checks of ``checkpoint="auto"`` that need neither model nor world (when the strategy is built)."""
    if settings.checkpoint != "auto":
        return
    model_schedule(settings)
    if settings.stage_count is None:
        raise config_error(
            "checkpoint='auto' with engine='distributed' and neither stages nor balance",
            "auto chooses a mode per stage before the processes meet, so the stage count must be fixed",
            "set stages (one per pipeline process, e.g. stages=2 on 2 processes) or balance",
        )


def usable_chunks(settings: PipeSettings, candidates: Sequence[int]) -> List[int]:
    """The chunk counts among ``candidates`` that the settings' schedule runs on their stages."""
    s = settings.resolved()
    assert s.stage_count is not None and s.virtual_stages is not None  # check_auto
    kind = lookup(s.schedule or "")
    stages = s.stage_count
    pp = stages // s.virtual_stages
    fit = [c for c in candidates if microbatch_rule(kind, c, pp, stages) is None]
    if not fit:
        raise config_error(
            f"checkpoint='auto' with chunks {list(candidates)}, schedule={s.schedule!r}, {stages} stages",
            str(microbatch_rule(kind, max(candidates), pp, stages)),
            "raise chunks (or add chunks to memory_search), or use schedule='gpipe'",
        )
    return fit


def adopt(settings: PipeSettings, topology: Optional[Topology]) -> PipeSettings:
    """``settings`` resolved, and, once the topology is known, checked against it: what the
    strategy writes into the engine after choosing (rank 0's plan) must run on the processes
    the topology already gave out stages to."""
    s = settings.resolved()
    if topology is None:
        return s
    if s.stage_count is not None and s.stage_count != topology.stages:
        raise config_error(
            f"a plan of {s.stage_count} stages on a pipeline of {topology.stages}",
            "the stages were given out to the processes before the plan was chosen",
            "set stages (or balance) to the pipeline's stage count",
        )
    check_chunks(topology.kind, s.chunks, pp=topology.pp, stages=topology.stages)
    if s.checkpoint != "auto":
        names = [s.checkpoint] if isinstance(s.checkpoint, str) else list(s.checkpoint)
        check_modes(topology.kind, parse_modes(names, len(names)))
    return s
