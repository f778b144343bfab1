"""How the distributed engine keeps a layout's data-parallel replicas where it shards nothing
(``data_parallel='ddp'``, ``dp > 1``), which decides when their gradients are reduced.

Why a module of its own: the engine keeps such replicas two ways, and the time model
(:mod:`pipeckpt.layout.rank_work`) prices them differently; the rule is the engine's, read here.

- Under DDP (a Sequential's stages, engines/distributed/wiring.py ``data_parallel``), whose reducer
  all-reduces the gradients as the last micro-batch's backward makes them: the reduction runs under
  that backward.
- Averaged after the step (engines/distributed/ties.py ``Replicas``): a ``pipeline_of`` model's
  replicas always (DDP wrapping a stage would miss the parameters outside its layers), and a
  Sequential's under a schedule that splits each backward (torch's input passes never arm DDP's
  reducer: engines/distributed/building.py ``_averaged_after_step``). Nothing of the reduction runs
  under a backward; the stages split as one replica's do.

Under FSDP2 (a shard degree above 1, or tensor parallelism: ``under_fsdp``) neither applies: FSDP2
reduces under the backward, whichever the model and schedule.
"""

from typing import Any

from pipeckpt.engines.distributed.schedules import lookup
from pipeckpt.engines.distributed.tensor_parallel import under_fsdp

__all__ = ["replicated", "reduced_after_step"]


def replicated(c: Any) -> bool:
    """Whether layout ``c`` keeps whole copies of its stages on ``dp > 1`` replicas (no FSDP2)."""
    return c.dp_replicate * c.dp_shard > 1 and not under_fsdp(c.dp_shard, c.tp)


def reduced_after_step(c: Any, *, module_pipeline: bool) -> bool:
    """Whether ``c``'s gradients are averaged over its replicas after the step, under no backward:
    a ``pipeline_of`` model's replicas, and a Sequential's under a split schedule."""
    return replicated(c) and (module_pipeline or lookup(c.schedule).traits.split_backward)
