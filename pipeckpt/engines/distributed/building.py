"""The distributed engine's half of the Engine protocol that builds this rank's stages.

Why a class of its own: building is one job with many parts (the plan every rank agrees on, this
rank's stages of an ``nn.Sequential`` or of a ``pipeline_of`` model, ties, replicas under DDP,
FSDP2 or averaged after the step, the schedules), and the engine class keeps to choosing and stepping; as
:class:`.checkpoints.EngineCheckpoints` does for files.
"""

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Set, Tuple

import torch
from lightning.pytorch import LightningModule
from torch import nn

from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.boundaries.side_inputs import Signatures
from pipeckpt.engines.distributed.agreed_plan import agreed_plan
from pipeckpt.engines.distributed.outside_parts import (
    OutsideParts,
    agreed_uses,
    held_parameters,
    outside_parts,
)
from pipeckpt.engines.distributed.processes import ProcessGroups
from pipeckpt.engines.distributed.rooted import RootRouting, build_rooted, check_module_pipeline
from pipeckpt.engines.distributed.schedules import ScheduleKind, Schedules
from pipeckpt.engines.distributed.sequence_parallel import end_ids
from pipeckpt.engines.distributed.sharding import Sharding, refuse_ties
from pipeckpt.engines.distributed.step import PipelinedStep
from pipeckpt.engines.distributed.tensor_parallel import layer_plan
from pipeckpt.engines.distributed.ties import Replicas, Ties, find_ties, replicas_of
from pipeckpt.engines.distributed.topology import Topology
from pipeckpt.engines.distributed.wiring import (
    StageModule,
    build_stages,
    called_outside_a_step,
    check_all_parameters_pipelined,
    data_parallel,
)
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.partition import StagePlan, module_name
from pipeckpt.stages.stage import Stage
from pipeckpt.weights.pretrained import pending_reads, read_later

__all__ = ["EngineBuilding"]


class EngineBuilding:
    """The building methods of :class:`~pipeckpt.engines.distributed.engine.DistributedEngine`."""

    settings: PipeSettings
    kind: ScheduleKind
    processes: ProcessGroups
    modules: List[StageModule]
    step: Optional[PipelinedStep]
    ties: Optional[Ties]
    replicas: Optional[Replicas]
    routing: Optional[RootRouting]
    root: Optional[nn.Module]
    sharding: Optional[Sharding]
    plan: Optional[StagePlan]
    module: Optional[LightningModule]
    sequential: Optional[nn.Sequential]
    _precision: str
    _device: torch.device

    if TYPE_CHECKING:  # the engine's and the Engine base class's, after this class in the bases

        @property
        def topology(self) -> Topology: ...

        @property
        def stages(self) -> List[Stage]: ...

        def seed_layers(
            self, sequential: nn.Sequential, plan: StagePlan, *, seed: Optional[int] = None
        ) -> None: ...

        def use_layer_streams(self, stages: Sequence[Stage]) -> None: ...

    def build(
        self, module: LightningModule, sequential: nn.Sequential, devices: Sequence[torch.device]
    ) -> None:
        if isinstance(sequential, ModulePipeline):
            self._build_module_pipeline(module, sequential)
            return
        check_all_parameters_pipelined(module, sequential)
        device = self._device  # this process's, from connect()
        stage_plan = self._prepare(module, sequential)
        step = PipelinedStep(
            module, sequential, [], self.processes, chunks=self.settings.chunks, device=device
        )
        name = f"self.{module_name(module, sequential)}"
        names = [f"{name[len('self.') :]}.{i}" for i in range(len(sequential))]
        ties = find_ties(module, sequential, stage_plan, self.topology, self.processes.rank)
        if ties and self.settings.data_parallel == "fsdp":
            refuse_ties(ties.names())
        self.modules = build_stages(
            sequential,
            stage_plan,
            self.topology.stages_of(self.processes.rank),
            device=device,
            pin_memory=self.settings.pin_memory,
            entry=step.first_stage_input,
            sides=step.side_inputs,
            names=names,
        )
        step.modules = self.modules
        step.configure(Signatures(name, list(zip(names, sequential))), stage_plan.ranges)
        if self._averaged_after_step():
            assert self.processes.dp_group is not None
            self.replicas = replicas_of(
                module, self.processes.dp_group, self.topology.dp, pending_reads(module)
            )
            trained: List[nn.Module] = list(self.modules)
        else:
            trained = [self._data_parallel(m) for m in self.modules]
        if self.sharding is None:  # a schedule's backward is one autograd call per micro-batch
            for stage in self.stages:
                stage.backward_per_microbatch = True
        self._finish(module, sequential, step, ties, trained=trained, routed=sequential)

    def _build_module_pipeline(self, module: LightningModule, spec: ModulePipeline) -> None:
        """``pipeline_of``: every stage runs the model's forward (:func:`.rooted.build_rooted`)."""
        s = self.settings
        name = module_name(module, spec.root)
        check_module_pipeline(name, s)
        check_all_parameters_pipelined(module, spec.root)
        names = [f"{name}.{n}" for n in spec.names]
        uses = agreed_uses(module, spec, self._device)  # which stages read each part outside the layers
        top = self.topology
        mine = top.stages_of(self.processes.rank)
        ranks = [[j for j in range(top.stages) if top.rank_of(j) == r] for r in range(top.pp)]
        found: List[OutsideParts] = []

        def outside(plan: StagePlan) -> Tuple[Set[int], Set[int]]:
            found.append(outside_parts(spec, uses, plan.ranges, mine, ranks))
            return found[-1].dropped, found[-1].shardable_tensors()

        stage_plan = self._prepare(module, spec, names=names, outside=outside)  # before the routing
        parts = found[-1] if found else outside_parts(spec, uses, stage_plan.ranges, mine, ranks)
        step = PipelinedStep(module, spec.root, [], self.processes, chunks=s.chunks, device=self._device)  # type: ignore[arg-type]
        self.modules, self.routing, self.replicas, ties = build_rooted(
            module,
            spec,
            stage_plan,
            step,
            names=names,
            processes=self.processes,
            pin_memory=s.pin_memory,
            parts=parts,
        )
        if (sharding := self._sharding()) is not None:  # the layers sharded, and what only this rank holds
            if sharding.tp is not None:  # its embedding and head split over the vocabulary first
                step.vocab_parallel = sharding.tp.split_outside(spec, parts.shardable)
                sharding.tp.ends = end_ids(spec)  # where sequence parallelism splits and gathers
            sharding.shard_layers(self.modules, self.replicas, outside=parts.shardable)
            step.outside = [p for _, p in held_parameters(spec.root, parts)]  # sharding made them anew
        self._finish(module, spec, step, ties, trained=list(self.modules), routed=spec.root)
        self.root = spec.root

    def _data_parallel(self, module: StageModule) -> nn.Module:
        """``module`` as its replicas train it: under DDP, or sharded over them (:mod:`.sharding`)."""
        if (sharding := self._sharding()) is None:
            return data_parallel(module, self.processes.dp_group, self.topology.dp, self._device)
        return sharding.shard(module, list(module.stage.partition.children()))

    def _averaged_after_step(self) -> bool:
        """Whether a Sequential's replicas average their gradients after the step
        (:class:`.ties.Replicas`, as a ``pipeline_of`` model's always do) rather than under DDP:
        where nothing is sharded and the schedule splits each backward. Torch runs an input pass
        with ``last_backward=False`` and a stage's own weight pass outside any backward DDP sees, so
        DDP's reducer never ran: each replica trained on its own data alone (dp2_zbv_* in
        tests/engines/distributed/test_distributed_engine_replicas.py). Unwrapped, the stages split too."""
        return self.kind.traits.split_backward and self.topology.dp > 1 and self._sharding() is None

    def _sharding(self) -> Optional[Sharding]:
        p = self.processes
        if self.sharding is None:
            self.sharding = Sharding.of(self.settings, p.mesh, precision=self._precision)
        return self.sharding

    def _prepare(
        self,
        module: LightningModule,
        layers: nn.Sequential,
        names: Optional[Sequence[str]] = None,
        outside: Optional[Callable[[StagePlan], Tuple[Set[int], Set[int]]]] = None,
    ) -> StagePlan:
        """The plan every process agrees on, its layers made ready (:func:`.wiring.agreed_plan`),
        each with its random stream (rank 0's seed; a resume restores its own later)."""
        # the tensor-parallel plan settled first: the user's, or a pipeline_of model's own
        s = self.settings = layer_plan(layers, self.settings)
        stages = self.topology.stages
        mine = self.topology.stages_of(self.processes.rank)
        self.plan, seed = agreed_plan(
            module, layers, s, stages=stages, device=self._device, names=names, mine=mine, outside=outside
        )
        self.seed_layers(layers, self.plan, seed=seed)
        return self.plan

    def _finish(
        self,
        module: LightningModule,
        sequential: nn.Sequential,
        step: PipelinedStep,
        ties: Optional[Ties],
        *,
        trained: List[nn.Module],
        routed: nn.Module,
    ) -> None:
        """What both kinds of pipeline end with once this rank's stages are built: ties made equal,
        random streams handed to the stages, the schedules, and ``routed`` (what the user calls)
        refusing calls outside a step. A pretrained checkpoint's reads held back for the shards are
        done first, each rank reading its own slices."""
        read_later(module)
        if ties:
            ties.broadcast()
            step.ties = ties
        self.ties = ties
        self.use_layer_streams(self.stages)
        assert self.plan is not None and self.processes.pp_group is not None
        step.schedules = Schedules(
            kind=self.kind,
            indices=[m.stage.index for m in self.modules],
            modules=self.modules,
            trained=trained,
            num_stages=self.plan.stages,
            device=self._device,
            group=self.processes.pp_group,
            loss_fn=step.microbatch_loss,
            reduce_every=bool(self.settings.reduce_every_microbatch),
        )
        self.step = step
        self.module = module
        routed.forward = called_outside_a_step
        self.sequential = sequential
