"""The ``distributed`` engine: one process per pipeline rank, on ``torch.distributed.pipelining``.

A rank holds one stage (or ``virtual_stages`` under a looped schedule) of the same
:class:`~pipeckpt.stages.partition.StagePlan` the local engine builds, each wrapped in the same
:class:`~pipeckpt.stages.stage.Stage`, so a checkpoint mode means the same under both engines.
This class composes the parts, one job each: :mod:`.processes`, :mod:`.schedules`, :mod:`.wiring`
and :mod:`.rooted` (this rank's stages), :mod:`.step` and :mod:`.replay` (the user's step per
micro-batch), :mod:`.boundaries`, :mod:`.ties`, :mod:`.state` and :mod:`.checkpoints` (files),
:mod:`.liveness` (a lost rank), :mod:`.auto_plan` (``'auto'``), :mod:`.sharding` (FSDP2).
"""

from contextlib import AbstractContextManager
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from pipeckpt._compat import STAGE_META_HOOKS
from pipeckpt._errors import config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.boundaries.side_inputs import Signatures
from pipeckpt.engines.base import Engine, World
from pipeckpt.engines.distributed.auto_plan import (
    adopt,
    model_schedule,
    same_on_every_rank,
    usable_chunks,
)
from pipeckpt.engines.distributed.checkpoints import EngineCheckpoints
from pipeckpt.engines.distributed.processes import SETTINGS, ProcessGroups, check_process_settings
from pipeckpt.engines.distributed.rooted import RootRouting, build_rooted, check_module_pipeline
from pipeckpt.engines.distributed.schedules import Schedules, lookup
from pipeckpt.engines.distributed.sharding import (
    Sharding,
    refuse_ties,
)
from pipeckpt.engines.distributed.state import StateIO
from pipeckpt.engines.distributed.step import PipelinedStep, check_backward_in_step
from pipeckpt.engines.distributed.ties import Replicas, Ties, find_ties
from pipeckpt.engines.distributed.topology import Topology
from pipeckpt.engines.distributed.wiring import (
    StageModule,
    agreed_plan,
    build_stages,
    called_outside_a_step,
    check_all_parameters_pipelined,
    data_parallel,
)
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.partition import StagePlan, module_name
from pipeckpt.stages.stage import Stage

__all__ = ["DistributedEngine"]


class DistributedEngine(EngineCheckpoints, Engine):
    """One process per pipeline rank; ``dp`` replicas of the pipeline average gradients with DDP
    or shard each stage with FSDP2."""

    name = "distributed"
    is_distributed = True
    backward_in_step = True
    restore_after_setup = True
    own_settings = SETTINGS
    foreign_settings = ("each process runs its stages on its own device", "drop `placement`")
    holds_every_layer = False  # the other ranks' layers are on the meta device

    def __init__(self, settings: PipeSettings) -> None:
        super().__init__(settings)
        self.kind = lookup(self.settings.schedule or "")
        self.processes = ProcessGroups(self.settings, self.kind)
        self.state = StateIO(self.processes)
        self.modules: List[StageModule] = []
        self.step: Optional[PipelinedStep] = None
        self.ties: Optional[Ties] = None
        self.replicas: Optional[Replicas] = None  # a module pipeline's, when dp > 1 (no DDP there)
        self.routing: Optional[RootRouting] = None  # a module pipeline's (pipeline_of)
        self.root: Optional[nn.Module] = None
        self.sharding: Optional[Sharding] = None  # data_parallel='fsdp' (made in build)
        self._precision = "32-true"
        self._device = torch.device("cpu")

    @classmethod
    def check_settings(cls, settings: PipeSettings) -> None:
        super().check_settings(settings)  # placement
        if not STAGE_META_HOOKS:
            raise config_error(
                f"engine='distributed' with torch {torch.__version__}",
                "the distributed engine builds on torch.distributed.pipelining as torch 2.13 ships it "
                "(PipelineStage._send_meta carries each stage's output structure); older stages "
                "lose the input gradients it sends back",
                "install torch>=2.13, or use engine='local' (one process, every GPU of the host)",
            )
        check_process_settings(cls.resolve(settings))

    def adopt(self, settings: PipeSettings) -> None:
        self.settings = adopt(self.resolve(settings), self.processes.topology)

    @classmethod
    def memory_schedule(cls, settings: PipeSettings) -> str:
        return model_schedule(cls.resolve(settings))

    @classmethod
    def auto_chunks(cls, settings: PipeSettings, candidates: Sequence[int]) -> List[int]:
        return usable_chunks(cls.resolve(settings), candidates)

    @classmethod
    def shares_device(cls, plan: StagePlan) -> bool:
        return False  # a device per process: the budget bounds each stage on its own

    def memory_layout(self) -> Dict[str, Any]:
        s = self.settings
        if s.data_parallel != "fsdp":
            return {}  # DDP: every replica holds its stage whole
        # FSDP2 gathers in the compute dtype only under bf16-mixed (.sharding.mixed_precision).
        precision = "32-true" if self._precision == "16-mixed" else self._precision
        return dict(
            fsdp=self.topology.shard_degree,  # dp_shard under hybrid sharding
            tp=self.topology.tp,
            reshard_after_forward=bool(s.reshard_after_forward),
            precision=precision,
            tp_plan=tuple((s.tensor_parallel_plan or {}).items()),
        )

    @classmethod
    def planning(cls) -> AbstractContextManager[None]:
        return same_on_every_rank()

    @property
    def topology(self) -> Topology:
        assert self.processes.topology is not None, "the world is not known yet"
        return self.processes.topology

    # -- processes and devices ----------------------------------------------------------

    def configure_world(self, world: World) -> None:
        self.processes.configure(world)

    def launcher(self, environment: ClusterEnvironment, world: World) -> Any:
        self.processes.world = world
        if not isinstance(self.settings.modes, str):
            # A per-stage list is checked against the stage count in the launching process, so a wrong
            # count is one error, said once, before any rank starts.
            self.settings.stage_modes(self.processes.configure(world).stages)
        return self.processes.launcher(environment)

    def connect(self, environment: ClusterEnvironment, device: torch.device) -> None:
        self._device = device
        self.processes.connect(environment, device)

    @property
    def device_mesh(self) -> Optional[Any]:
        return self.processes.mesh

    def root_device(self, devices: Sequence[torch.device], local_rank: int) -> torch.device:
        return devices[local_rank] if devices else torch.device("cpu")

    def sampler_kwargs(self, global_rank: int) -> Dict[str, Any]:
        # All ranks of one pipeline see the same batch; replicas see different ones.
        return {"num_replicas": self.topology.dp, "rank": self.topology.replica_of(global_rank)}

    def check_module(self, module: LightningModule, precision: Any) -> None:
        check_backward_in_step(module, precision)
        self._precision = str(getattr(precision, "precision", "32-true"))

    # -- building -------------------------------------------------------------------

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
        stage_plan = self._prepare(module, spec, names=names)  # before the routing takes the layers' forward
        step = PipelinedStep(module, spec.root, [], self.processes, chunks=s.chunks, device=self._device)  # type: ignore[arg-type]
        self.modules, self.routing, self.replicas, ties = build_rooted(
            module, spec, stage_plan, step, names=names, processes=self.processes, pin_memory=s.pin_memory
        )
        if (sharding := self._sharding()) is not None:  # the layers sharded; the rest stays replicated
            sharding.shard_layers(self.modules, self.replicas)
        self._finish(module, spec, step, ties, trained=list(self.modules), routed=spec.root)
        self.root = spec.root

    def _data_parallel(self, module: StageModule) -> nn.Module:
        """``module`` as its replicas train it: under DDP, or sharded over them (:mod:`.sharding`)."""
        if (sharding := self._sharding()) is None:
            return data_parallel(module, self.processes.dp_group, self.topology.dp, self._device)
        return sharding.shard(module, list(module.stage.partition.children()))

    def _sharding(self) -> Optional[Sharding]:
        p = self.processes
        if self.sharding is None:
            self.sharding = Sharding.of(self.settings, p.mesh, precision=self._precision)
        return self.sharding

    def _prepare(
        self, module: LightningModule, layers: nn.Sequential, names: Optional[Sequence[str]] = None
    ) -> StagePlan:
        """The plan every process agrees on, its layers made ready (:func:`.wiring.agreed_plan`),
        each with its random stream (rank 0's seed; a resume restores its own later)."""
        s, stages = self.settings, self.topology.stages
        mine = self.topology.stages_of(self.processes.rank)
        self.plan, seed = agreed_plan(
            module, layers, s, stages=stages, device=self._device, names=names, mine=mine
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
        refusing calls outside a step."""
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
        )
        self.step = step
        self.module = module
        routed.forward = called_outside_a_step
        self.sequential = sequential

    @property
    def stages(self) -> List[Stage]:
        return [m.stage for m in self.modules]

    # -- one step -------------------------------------------------------------------

    def run(self, hook: str, module: LightningModule, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        assert self.step is not None
        if hook == "training_step" and self.layer_rng.enabled:
            self.layer_rng.next_call()
        try:
            result = self.step(hook, args, kwargs)
        except StopIteration as error:
            # Lightning's loop takes a StopIteration for the end of the data: this rank alone would end
            # its epoch, and the others would wait for it in their next collective until they time out.
            raise RuntimeError(
                f"{hook} raised StopIteration on this rank: Lightning would end the epoch here alone, "
                "while the other ranks wait for it. HINT: raise another exception type, or end the "
                "data in the loader"
            ) from error
        if hook != "training_step" and self.sharding is not None:
            self.sharding.reshard(self.modules)
        return result

    def take_step_gradients(self) -> None:
        assert self.step is not None
        if self.replicas is not None:  # averaged over replicas, then (in take_gradients) summed over ties
            self.step.gradients = self.replicas.average(self.step.gradients)
        self.step.take_gradients()

    def total_norm(self, grads: List[Tensor], device: torch.device) -> Tensor:
        if self.ties is not None:
            grads = self.ties.counted_once(grads)
        if self.sharding is not None:
            squared = self.sharding.squared_norm(grads, device)
        else:
            squared = super().total_norm(grads, device) ** 2
        if self.topology.pp > 1:  # replicas hold the same gradients, averaged by DDP or Replicas
            dist.all_reduce(squared, group=self.processes.pp_group)
        return squared.sqrt()

    # -- failures and the end -----------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        if self.processes.liveness is None:
            return
        timeout = float(self.settings.timeout or 0)
        rank, describe = self.processes.rank, self.topology.describe
        message = self.processes.liveness.explain(exception, me=rank, describe=describe, timeout=timeout)
        if message is None:
            return
        print(message, flush=True)  # at once: a launcher may kill this process before it unwinds
        exception.args = (f"{message}\n{exception.args[0] if exception.args else ''}", *exception.args[1:])

    def teardown(self, module: Optional[LightningModule]) -> None:
        if self.routing is not None:
            self.routing.restore()
        if self.root is not None:
            self.root.__dict__.pop("forward", None)
        self.processes.close()
        if self.sharding is not None:  # a step that failed may have left parameters gathered
            self.sharding.reshard(self.modules)
        if self.step is not None:
            self.step.clear()
        super().teardown(module)
