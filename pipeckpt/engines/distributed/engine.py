"""The ``distributed`` engine: one process per pipeline rank, on ``torch.distributed.pipelining``.

A pipeline rank holds one stage (or ``virtual_stages`` under a looped schedule)
of the same :class:`~pipeckpt.planning.StagePlan` the local engine builds, each
wrapped in the same :class:`~pipeckpt.stage.Stage`, so a checkpoint mode means
the same under both engines. This class only composes the parts, one job each:

- :mod:`.processes`: world, topology, launcher, process groups, liveness;
- :mod:`.schedules`: torch's schedules by name, what each needs;
- :mod:`.wiring`: this process's stages (others' layers on the meta device), DDP over replicas;
- :mod:`.step` and :mod:`.replay`: the user's unchanged step, per micro-batch, through the schedule;
- :mod:`.boundaries`: any pytree between stages, its structure learnt at shape inference;
- :mod:`.ties`: weights tied across ranks, one parameter with copies kept equal;
- :mod:`.state`: model, optimizer and RNG state under the module's own keys;
- :mod:`.liveness`: naming a lost rank when a collective fails.
"""

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.optim import Optimizer

from pipeckpt import safe_load, sharded
from pipeckpt._errors import config_error
from pipeckpt.batch_norm import convert_deferred_batch_norm
from pipeckpt.compiling import compile_layers
from pipeckpt.engines.base import Engine, World
from pipeckpt.engines.distributed.auto_plan import adopt, check_auto
from pipeckpt.engines.distributed.liveness import error_message, lost_message, own_error
from pipeckpt.engines.distributed.processes import ProcessGroups
from pipeckpt.engines.distributed.rooted import (
    RootRouting,
    RootStageModule,
    check_module_pipeline,
    outside_parameters,
)
from pipeckpt.engines.distributed.schedules import Schedules, check_modes, lookup
from pipeckpt.engines.distributed.state import StateIO
from pipeckpt.engines.distributed.step import PipelinedStep
from pipeckpt.engines.distributed.ties import Replicas, Ties, find_ties, held_by_every_rank
from pipeckpt.engines.distributed.topology import Topology, check_kind
from pipeckpt.engines.distributed.wiring import (
    StageModule,
    build_stages,
    called_outside_a_step,
    check_all_parameters_pipelined,
    data_parallel,
)
from pipeckpt.modes import parse_modes
from pipeckpt.planning import StagePlan, module_name, plan
from pipeckpt.settings import PipeSettings
from pipeckpt.side_inputs import Signatures
from pipeckpt.split import ModulePipeline
from pipeckpt.stage import Stage

__all__ = ["DistributedEngine"]


class DistributedEngine(Engine):
    """One process per pipeline rank; ``dp`` replicas of the pipeline average gradients with DDP."""

    name = "distributed"
    is_distributed = True
    backward_in_step = True
    restore_after_setup = True

    def __init__(self, settings: PipeSettings) -> None:
        super().__init__(settings.resolved())
        self.kind = lookup(self.settings.schedule or "")
        self.processes = ProcessGroups(self.settings, self.kind)
        self.state = StateIO(self.processes)
        self.modules: List[StageModule] = []
        self.step: Optional[PipelinedStep] = None
        self.ties: Optional[Ties] = None
        self.replicas: Optional[Replicas] = None  # a module pipeline's, when dp > 1 (no DDP there)
        self.routing: Optional[RootRouting] = None  # a module pipeline's (pipeline_of)
        self.root: Optional[nn.Module] = None
        self._device = torch.device("cpu")

    @classmethod
    def check_settings(cls, settings: PipeSettings) -> None:
        s = settings.resolved()
        assert s.schedule is not None and s.virtual_stages is not None
        kind = lookup(s.schedule)
        check_kind(kind, s.virtual_stages)
        check_auto(s)  # checkpoint='auto': gpipe or 1f1b, the stage count fixed
        if s.checkpoint == "auto":
            return  # the modes are chosen at set-up (pipeckpt.budget), then checked by adopt()
        names = [s.checkpoint] if isinstance(s.checkpoint, str) else s.checkpoint
        check_modes(kind, parse_modes(names, len(names)))

    @property
    def topology(self) -> Topology:
        assert self.processes.topology is not None, "the world is not known yet"
        return self.processes.topology

    # -- processes and devices ----------------------------------------------------------

    def configure_world(self, world: World) -> None:
        self.processes.configure(world)

    def launcher(self, environment: ClusterEnvironment, world: World) -> Any:
        self.processes.world = world
        return self.processes.launcher(environment)

    def connect(self, environment: ClusterEnvironment, device: torch.device) -> None:
        self._device = device
        self.processes.connect(environment, device)

    def root_device(self, devices: Sequence[torch.device], local_rank: int) -> torch.device:
        return devices[local_rank] if devices else torch.device("cpu")

    def sampler_kwargs(self, global_rank: int) -> Dict[str, Any]:
        # All ranks of one pipeline see the same batch; replicas see different ones.
        return {"num_replicas": self.topology.dp, "rank": global_rank // self.topology.pp}

    def check_module(self, module: LightningModule, precision: Any) -> None:
        if not module.automatic_optimization:
            raise config_error(
                f"{type(module).__name__} uses manual optimization",
                "the distributed engine's schedule runs backward itself, inside training_step",
                "use automatic optimization, or engine='local'",
            )
        if getattr(precision, "scaler", None) is not None:
            raise config_error(
                "precision='16-mixed' (a gradient scaler)",
                "the schedule runs backward inside training_step, where the scaler cannot scale it",
                "use precision='bf16-mixed' or '32-true' with the distributed engine",
            )

    # -- building -------------------------------------------------------------------

    def build(
        self, module: LightningModule, sequential: nn.Sequential, devices: Sequence[torch.device]
    ) -> None:
        self.settings = adopt(self.settings, self.topology)  # checkpoint='auto': rank 0's chosen plan
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
        trained = [data_parallel(m, self.processes.dp_group, self.topology.dp, device) for m in self.modules]
        self._finish(module, sequential, step, ties, trained=trained, routed=sequential)

    def _build_module_pipeline(self, module: LightningModule, spec: ModulePipeline) -> None:
        """``pipeline_of``: every stage runs the model's forward (:mod:`.rooted`); the parameters
        outside the layers live on every rank, one tie each. Replicas (``dp > 1``) average every
        gradient this rank holds (:class:`.ties.Replicas`), not through DDP: a stage module does not
        hold the parameters outside the layers, which its replay of ``forward`` trains too."""
        s, topology = self.settings, self.topology
        name = module_name(module, spec.root)
        check_module_pipeline(name, s)
        check_all_parameters_pipelined(module, spec.root)
        device = self._device
        names = [f"{name}.{n}" for n in spec.names]
        stage_plan = self._prepare(module, spec, names=names)  # before the routing takes the layers' forward
        step = PipelinedStep(module, spec.root, [], self.processes, chunks=s.chunks, device=device)  # type: ignore[arg-type]
        outside = outside_parameters(spec, module)
        assert self.processes.pp_group is not None
        rank = self.processes.rank
        src = self.processes.replica * topology.pp
        ties = find_ties(module, spec, stage_plan, topology, rank)
        everywhere = {id(p) for _, p in outside}
        ties = Ties([t for t in ties.ties if id(t.param) not in everywhere]) + held_by_every_rank(
            outside, stages=stage_plan.stages, group=self.processes.pp_group, src=src, primary=rank == src
        )
        routing = RootRouting(spec, stage_plan.ranges, names)
        self.modules = build_stages(
            spec,
            stage_plan,
            topology.stages_of(rank),
            device=device,
            pin_memory=s.pin_memory,
            names=names,
            keep=everywhere,
            make=lambda stage: RootStageModule(stage, routing, entry=step.root_call, calls=step.call_of),
        )
        routing.stages = {m.stage.index: m.stage for m in self.modules}
        self.routing = routing
        step.modules = self.modules
        step.outside = [p for _, p in outside]
        if topology.dp > 1:
            assert self.processes.dp_group is not None
            self.replicas = Replicas(
                module, group=self.processes.dp_group, src=self.processes.pipeline_rank, size=topology.dp
            )
            self.replicas.broadcast()  # before the ties: each replica's copies then start from replica 0's
        self._finish(module, spec, step, ties, trained=list(self.modules), routed=spec.root)
        self.root = spec.root

    def _prepare(
        self, module: LightningModule, layers: nn.Sequential, names: Optional[Sequence[str]] = None
    ) -> StagePlan:
        """The plan every process agrees on, and the layers made ready for it: deferred BatchNorm,
        compiled, each with its random stream (rank 0's seed; a resume restores its own later)."""
        s = self.settings
        stage_plan = self._plan(module, layers, self._device, s.balance, names=names)
        # A profiled balance may differ between processes, and so may torch.initial_seed().
        agreed: List[Any] = [list(stage_plan.balance), torch.initial_seed()]
        dist.broadcast_object_list(agreed, src=0)
        if tuple(agreed[0]) != stage_plan.balance:
            stage_plan = self._plan(module, layers, self._device, agreed[0], names=names)
        self.plan = stage_plan
        if s.deferred_batch_norm:
            convert_deferred_batch_norm(layers, s.chunks)
        compile_layers(layers, s.compile)
        self.seed_layers(layers, stage_plan, seed=agreed[1])
        return stage_plan

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

    def _plan(
        self,
        module: LightningModule,
        sequential: nn.Sequential,
        device: torch.device,
        balance: Any,
        names: Optional[Sequence[str]] = None,
    ) -> StagePlan:
        s = self.settings
        module_pipeline = isinstance(sequential, ModulePipeline)
        return plan(
            sequential,
            devices=[device],
            stages=self.topology.stages,
            balance=balance,
            balance_by=s.balance_by,
            checkpoint=s.checkpoint,
            sample=None if module_pipeline else getattr(module, "example_input_array", None),
            chunks=s.chunks,
            names=names,
        )

    @property
    def stages(self) -> List[Stage]:
        return [m.stage for m in self.modules]

    # -- one step -------------------------------------------------------------------

    def run(self, hook: str, module: LightningModule, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        assert self.step is not None
        if hook == "training_step" and self.layer_rng.enabled:
            self.layer_rng.next_call()
        return self.step(hook, args, kwargs)

    def take_step_gradients(self) -> None:
        assert self.step is not None
        if self.replicas is not None:  # averaged over replicas, then (in take_gradients) summed over ties
            self.step.gradients = self.replicas.average(self.step.gradients)
        self.step.take_gradients()

    def total_norm(self, grads: List[Tensor], device: torch.device) -> Tensor:
        if self.ties is not None:
            grads = self.ties.counted_once(grads)
        squared = super().total_norm(grads, device) ** 2
        if self.topology.pp > 1:  # replicas hold the same gradients, averaged by DDP or Replicas
            dist.all_reduce(squared, group=self.processes.pp_group)
        return squared.sqrt()

    # -- state ----------------------------------------------------------------------

    def module_state_dict(self, module: LightningModule) -> Dict[str, Any]:
        return self.state.module_state_dict(module)

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        assert self.module is not None
        return self.state.optimizer_state(self.module, optimizer)

    def rng_states(self) -> List[Dict[str, Any]]:
        return self.state.rng_states()

    def my_rng_state(self, by_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
        return self.state.my_rng_state(by_rank)

    def save_checkpoint(
        self,
        checkpoint: Dict[str, Any],
        path: Any,
        io: CheckpointIO,
        storage_options: Optional[Any],
        is_zero: bool,
    ) -> None:
        if self.replicas is not None and self.processes.replica > 0:
            checkpoint = _without_tensors(checkpoint)  # replica 0's copies are written, once
        sharded.save(checkpoint, path)  # every rank writes its own stages

    def load_checkpoint(self, path: Any, io: CheckpointIO, weights_only: Optional[bool]) -> Dict[str, Any]:
        if sharded.is_sharded(path) or os.path.isdir(path):  # an incomplete one is named by sharded.load
            assert self.module is not None, "restored after build (restore_after_setup)"
            return self.state.load_sharded(path, self.module, weights_only)
        return safe_load.load_with(io, path, weights_only)  # a single file, the local engine's

    def load_module_state_dict(self, module: LightningModule, state: Dict[str, Any], strict: bool) -> None:
        self.state.load_module_state(module, state, strict)

    def load_optimizer_state(self, optimizer: Optimizer, state: Dict[str, Any]) -> None:
        self.state.load_optimizer_state(optimizer, self._by_index(optimizer, state))

    # -- failures and the end -----------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        liveness = self.processes.liveness
        if liveness is None:
            return
        own = own_error(exception)
        liveness.report(exception, own=own)
        if own or isinstance(exception, (SystemExit, KeyboardInterrupt)):
            return  # this rank's own error (or an exit): it propagates as raised, the others quote it
        timeout = float(self.settings.timeout or 0)
        found = liveness.diagnose(within=min(timeout, liveness.silence_s))
        describe = self.topology.describe
        if found.errors:
            message = error_message(me=self.processes.rank, errors=found.errors, describe=describe)
        else:
            message = lost_message(
                me=self.processes.rank, lost=found.lost, describe=describe, timeout=timeout
            )
        print(message, flush=True)  # at once: a launcher may kill this process before it unwinds
        exception.args = (f"{message}\n{exception.args[0] if exception.args else ''}", *exception.args[1:])

    def teardown(self, module: Optional[LightningModule]) -> None:
        if self.routing is not None:
            self.routing.restore()
        if self.root is not None:
            self.root.__dict__.pop("forward", None)
        self.processes.close()
        if self.step is not None:
            self.step.clear()
        super().teardown(module)


def _without_tensors(checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    """``checkpoint`` with no model or optimizer tensors: what a replica whose copies another writes
    hands to the (collective) sharded writer."""
    out = dict(checkpoint, state_dict={})
    if "optimizer_states" in out:
        out["optimizer_states"] = [dict(o, state={}) for o in out["optimizer_states"]]
    return out
