"""``checkpoint="auto"`` under the distributed engine: what a budgeted plan must respect here.

The choice itself is engine-free (:func:`pipeckpt.memory.budget.resolve_auto`), made once on
global rank 0 and broadcast before any stage is built (profiled times differ between processes).
What only this engine knows lives here: the schedules the memory model covers, that the stage
count must be fixed by the settings, the micro-batch counts a schedule accepts, and the check of
the chosen settings against the topology. Every function takes settings the engine resolved.
The budget is per process: each stage's predicted peak is compared with it on its own.
"""

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence

from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.liveness import user_code
from pipeckpt.engines.distributed.schedules import lookup, microbatch_rule
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


def model_schedule(s: PipeSettings) -> str:
    """The memory model's name of the (resolved) settings' schedule; a config error when it has none."""
    kind = lookup(s.schedule or "")
    name = AUTO_SCHEDULES.get(kind.cls.__name__)
    if name is None and s.modes != "auto":
        return str(s.schedule)  # modes given: the memory model names the schedules it knows
    if name is None:
        raise config_error(
            f"checkpoint='auto' with schedule={s.schedule!r}",
            f"the memory model behind auto predicts the schedules {list(AUTO_SCHEDULES.values())} only",
            "set schedule='gpipe' or '1f1b', or choose the modes yourself (checkpoint=[...]; "
            "`python -m pipeckpt.plan` predicts each stage's peak for the modes you give)",
        )
    return name


def check_auto(settings: PipeSettings) -> None:
    """Checks of ``checkpoint="auto"`` (resolved settings) that need neither model nor world."""
    if settings.modes != "auto":
        return
    model_schedule(settings)
    if settings.stage_count is None:
        raise config_error(
            "checkpoint='auto' with engine='distributed' and neither stages nor balance",
            "auto chooses a mode per stage before the processes meet, so the stage count must be fixed",
            "set stages (one per pipeline process, e.g. stages=2 on 2 processes) or balance",
        )


def usable_chunks(s: PipeSettings, candidates: Sequence[int]) -> List[int]:
    """The chunk counts among ``candidates`` that the (resolved) settings' schedule runs on their stages."""
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


def adopt(s: PipeSettings, topology: Optional[Topology]) -> PipeSettings:
    """``s`` (resolved) checked, once the topology is known, against it: the plan chosen at set-up
    must run on the processes the topology already gave out stages to."""
    if topology is None:
        return s
    if s.stage_count is not None and s.stage_count != topology.stages:
        raise config_error(
            f"a plan of {s.stage_count} stages on a pipeline of {topology.stages}",
            "the stages were given out to the processes before the plan was chosen",
            "set stages (or balance) to the pipeline's stage count",
        )
    check_chunks(topology.kind, s.chunks, pp=topology.pp, stages=topology.stages)
    return s
