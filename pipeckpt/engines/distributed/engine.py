"""The ``distributed`` engine: one process per pipeline rank, on ``torch.distributed.pipelining``.

A rank holds one stage (or ``virtual_stages`` under a looped schedule) of the same
:class:`~pipeckpt.stages.partition.StagePlan` the local engine builds, each wrapped in the same
:class:`~pipeckpt.stages.stage.Stage`, so a checkpoint mode means the same under both engines.
This class composes the parts, one job each: :mod:`.processes`, :mod:`.schedules`, :mod:`.building`,
:mod:`.wiring` and :mod:`.rooted` (this rank's stages), :mod:`.step` and :mod:`.replay` (the user's step per
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
from pipeckpt.engines.base import Engine, World
from pipeckpt.engines.distributed.auto_plan import (
    adopt,
    model_schedule,
    same_on_every_rank,
    usable_chunks,
)
from pipeckpt.engines.distributed.building import EngineBuilding
from pipeckpt.engines.distributed.checkpoints import EngineCheckpoints
from pipeckpt.engines.distributed.processes import SETTINGS, ProcessGroups, check_process_settings
from pipeckpt.engines.distributed.rooted import RootRouting
from pipeckpt.engines.distributed.schedules import lookup
from pipeckpt.engines.distributed.sharding import (
    Sharding,
)
from pipeckpt.engines.distributed.state import StateIO
from pipeckpt.engines.distributed.step import PipelinedStep, check_backward_in_step
from pipeckpt.engines.distributed.tensor_parallel import layer_plan
from pipeckpt.engines.distributed.ties import Replicas, Ties
from pipeckpt.engines.distributed.topology import Topology
from pipeckpt.engines.distributed.wiring import (
    StageModule,
)
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.partition import StagePlan
from pipeckpt.stages.stage import Stage

__all__ = ["DistributedEngine"]


class DistributedEngine(EngineBuilding, EngineCheckpoints, Engine):
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

    def memory_layout(self, layers: Optional[nn.Sequential] = None) -> Dict[str, Any]:
        s = self.settings
        if s.data_parallel != "fsdp":
            return {}  # DDP: every replica holds its stage whole
        if layers is not None:  # the plan the build will apply: a pipeline_of model's own, if none given
            s = layer_plan(layers, s)
        # FSDP2 gathers in the compute dtype only under bf16-mixed (.sharding.mixed_precision).
        precision = "32-true" if self._precision == "16-mixed" else self._precision
        return dict(
            fsdp=self.topology.shard_degree,  # dp_shard under hybrid sharding
            tp=self.topology.tp,
            reshard_after_forward=bool(s.reshard_after_forward),
            reduce_every_microbatch=bool(s.reduce_every_microbatch),
            precision=precision,
            tp_plan=tuple((s.tensor_parallel_plan or {}).items()),
            sequence_parallel=bool(s.sequence_parallel),
            gloo=self._device.type == "cpu",  # Lightning's process group on CPU
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
            self.sharding.reshard([*self.modules, *self.sharding.outside])
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
            self.sharding.reshard([*self.modules, *self.sharding.outside])
        if self.step is not None:
            self.step.clear()
        super().teardown(module)
