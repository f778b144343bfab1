"""The stage plan every process agrees on, and a meta build made real for it on each process.

Why apart from the wiring: agreeing (rank 0's balance and seed, broadcast) and making this process's
share of a meta build real happen once, before any stage exists; the wiring then builds stages
from what is real. Moved out of ``.wiring`` when a module pipeline's outside parts joined what a
process may leave on meta (``.outside_parts``).
"""

from dataclasses import replace
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.checkpointing.compiling import compile_layers, recomputed_layers, selective_layers
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.batch_norm import convert_deferred_batch_norm
from pipeckpt.stages.materialize import built_on_meta, materialize
from pipeckpt.stages.partition import StagePlan, plan, split
from pipeckpt.weights.pretrained import reading_later

__all__ = ["agreed_plan", "materialize_mine"]


def materialize_mine(
    module: nn.Module,
    layers: nn.Sequential,
    stage_plan: StagePlan,
    mine: Sequence[int],
    device: torch.device,
    *,
    sharded: bool = False,
    outside: Tuple[Set[int], Set[int]] = (set(), set()),
) -> None:
    """``module``'s meta tensors made real on ``device``, but for the layers of stages other than
    ``mine`` (which stay on meta): every initial value as an eager build with the same seed draws it,
    and no draw past this process's last layer. ``sharded``: this process will hold only shards of
    its layers' tensors, so a pretrained checkpoint is read into them once they are laid out
    (``weights.pretrained.read_later``, after sharding), each rank its own slices. ``outside``: of
    a module pipeline's tensors outside the layers, the ids of those no stage of this process reads
    (left on meta) and of those it shards too (read once sharded)."""
    parts = split(layers, stage_plan.balance)
    elsewhere = {id(t) for j, p in enumerate(parts) if j not in mine for t in (*p.parameters(), *p.buffers())}
    own = {id(t) for j in mine for t in (*parts[j].parameters(), *parts[j].buffers())}
    elsewhere -= own
    dropped, shardable = outside
    elsewhere |= dropped
    with reading_later(own | shardable if sharded else set()):
        materialize(module, device, keep=lambda t: id(t) not in elsewhere, agree=_past_every_draw)


def _past_every_draw(mine: Optional[Any]) -> Any:
    """The generators' states past every initial draw, from a process that drew them all (one that
    holds the last layer): the others stop after their own last layer."""
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return next(s for s in every if s is not None)


def agreed_plan(
    module: LightningModule,
    layers: nn.Sequential,
    settings: PipeSettings,
    *,
    stages: int,
    device: torch.device,
    names: Optional[Sequence[str]] = None,
    mine: Sequence[int] = (),
    outside: Optional[Callable[[StagePlan], Tuple[Set[int], Set[int]]]] = None,
) -> Tuple[StagePlan, int]:
    """The plan of ``stages`` stages every process agrees on (rank 0's: a profiled balance may
    differ between processes, and so may ``torch.initial_seed()``, returned with it), and the
    layers made ready for it: those of this process's stages ``mine`` made real when the module was
    built on the meta device (:func:`materialize_mine`; ``outside(plan)``: its ``outside``),
    deferred BatchNorm, compiled."""
    meta_build = built_on_meta(module)
    if meta_build and settings.balance is None and settings.balance_by != "params":
        raise config_error(
            f"balance_by={settings.balance_by!r} with a module built on the meta device",
            "profiling runs the layers, which no process holds whole under this engine",
            "use balance_by='params' or an explicit balance, or build the module eagerly",
        )

    def planned(balance: Optional[Sequence[int]]) -> StagePlan:
        s = replace(settings, stages=None, balance=list(balance)) if balance is not None else settings
        s = replace(s, stages=stages) if balance is None else s
        example = getattr(module, "example_input_array", None)
        sample = None if isinstance(layers, ModulePipeline) else example
        return plan(layers, s, [device], sample=sample, names=names)

    stage_plan = planned(settings.balance)
    agreed: List[Any] = [list(stage_plan.balance), torch.initial_seed()]
    dist.broadcast_object_list(agreed, src=0)
    if tuple(agreed[0]) != stage_plan.balance:
        stage_plan = planned(agreed[0])
    if meta_build:
        materialize_mine(
            module,
            layers,
            stage_plan,
            mine,
            device,
            sharded=settings.data_parallel == "fsdp",
            outside=outside(stage_plan) if outside is not None else (set(), set()),
        )
    if settings.deferred_batch_norm:
        convert_deferred_batch_norm(layers, settings.chunks)
    compile_layers(
        layers,
        settings.compile,
        selective=selective_layers(stage_plan.ranges, stage_plan.modes),
        recomputed=recomputed_layers(stage_plan.ranges, stage_plan.modes),
    )
    return stage_plan, int(agreed[1])
