"""The engine protocol: what :class:`~pipeckpt.strategy.PipelineStrategy` asks of the code that runs stages.

The strategy owns everything Lightning sees, once for every engine; an engine owns how a plan's
stages run (in which processes, on which devices, in which order) and what it tells the planners.
:class:`Engine` implements the one-process behaviour, so an engine overrides only what it changes.
The call order and the members are in docs/ARCHITECTURE.md, "The engine protocol".
"""

import os
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.optim import Optimizer

from pipeckpt import _rng
from pipeckpt._compat import apply_to_tensors, set_module_device
from pipeckpt._errors import config_error
from pipeckpt.checkpointing.compiling import uncompile_layers
from pipeckpt.checkpointing.layer_rng import LayerStreams
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.partition import StagePlan
from pipeckpt.stages.stage import Stage
from pipeckpt.state import safe_load, sharded

__all__ = ["Engine", "World", "optimizer_param_names"]


def optimizer_param_names(module: nn.Module, optimizer: Optimizer) -> List[str]:
    """The module's name of each of the optimizer's parameters, in the optimizer's order."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


@dataclass(frozen=True)
class World:
    """The processes of the run, as the Trainer sees them."""

    num_nodes: int
    num_processes: int  # on each node
    global_rank: int = 0

    @property
    def size(self) -> int:
        return max(1, self.num_nodes * self.num_processes)


class Engine(ABC):
    """Runs a plan's stages. Subclasses set :attr:`name` and implement :meth:`build` and :meth:`run`."""

    name: str = ""
    is_distributed: bool = False  # several processes: Lightning injects samplers and reduces logs
    restore_after_setup: bool = False  # restore checkpoints into the built stages, not the whole module
    backward_in_step: bool = False  # the schedule runs backward inside ``run`` (see take_step_gradients)

    #: The per-engine settings (:meth:`PipeSettings.per_engine`) this engine runs, each with the
    #: value it takes when left unset (None); the others are refused by :meth:`check_settings`.
    own_settings: ClassVar[Mapping[str, Any]] = {}
    #: Why the per-engine settings this engine does not run mean nothing here, and what to do.
    foreign_settings: ClassVar[Tuple[str, str]] = ("this engine does not run them", "drop them")
    #: Every layer of the model is in this process, so the memory model can profile them here.
    holds_every_layer: ClassVar[bool] = True

    def __init__(self, settings: PipeSettings) -> None:
        self.settings = self.resolve(settings)
        self.plan: Optional[StagePlan] = None
        self.sequential: Optional[nn.Sequential] = None
        self.module: Optional[LightningModule] = None  # set by build()
        # Per-layer random streams (checkpointing.layer_rng); their seed and call count are checkpointed.
        self.layer_rng = LayerStreams(self.settings.layer_rng)

    # -- settings, and what the planners ask ---------------------------------------------

    @classmethod
    def resolve(cls, settings: PipeSettings) -> PipeSettings:
        """``settings`` with this engine's defaults for the settings of its own left unset."""
        unset = {k: v for k, v in cls.own_settings.items() if v is not None and getattr(settings, k) is None}
        return replace(settings, **unset) if unset else settings

    @classmethod
    def check_settings(cls, settings: PipeSettings) -> None:
        """Engine-specific checks that need neither model nor world; raise ``config_error``.
        Here: a per-engine setting this engine does not run is refused, and ``layout='auto'``, which
        is searched before an engine runs (:mod:`pipeckpt.strategy_layout`,
        :func:`pipeckpt.plan_pick.apply_layout`), never reaches it."""
        if settings.layout == "auto":
            raise config_error(
                "layout='auto' handed to an engine",
                "an engine runs a layout; 'auto' is searched before any engine runs, with the model "
                "and the cluster",
                "build PipelineStrategy(layout='auto', cluster=...), which searches at trainer.fit, "
                "or run train.py strategy.layout=auto (docs/LAYOUT.md, 'The search')",
            )
        given = [n for n in PipeSettings.per_engine() if n not in cls.own_settings]
        given = [n for n in given if getattr(settings, n) is not None]
        if given:
            values = ", ".join(f"{n}={getattr(settings, n)!r}" for n in given)
            rule, hint = cls.foreign_settings
            raise config_error(f"{values} with engine={settings.engine!r}", rule, hint)

    def adopt(self, settings: PipeSettings) -> None:
        """Run ``settings`` instead of those given at construction (``checkpoint='auto'``: the plan
        chosen at set-up, before :meth:`build`)."""
        self.settings = self.resolve(settings)

    @classmethod
    def memory_schedule(cls, settings: PipeSettings) -> str:
        """The op order the memory model walks for this engine (``memory.schedule.SCHEDULES``)."""
        return "local"

    @classmethod
    def auto_chunks(cls, settings: PipeSettings, candidates: Sequence[int]) -> List[int]:
        """``checkpoint='auto'``: the chunk counts among ``candidates`` this engine can run."""
        return list(candidates)

    @classmethod
    def shares_device(cls, plan: StagePlan) -> bool:
        """Whether the plan's stages share one device, whose budget then bounds them together."""
        return len(set(plan.devices)) == 1 and plan.stages > 1

    def memory_layout(self, layers: Optional[nn.Sequential] = None) -> Dict[str, Any]:
        """``checkpoint='auto'`` (the world known): how each stage's parameters, gradients and
        optimizer state are spread over the ranks that run it, as the fields of
        :class:`~pipeckpt.memory.sharding.Layout` (``fsdp``, ``tp``, ``reshard_after_forward``,
        ``reduce_every_microbatch``, ``precision``, ``tp_plan``). Empty: every stage is held whole
        by its device. ``layers``: the pipelined Sequential, when the spread depends on the model (a
        plan of its own)."""
        return {}

    @classmethod
    def planning(cls) -> AbstractContextManager[None]:
        """Around ``checkpoint='auto'``'s choice (which runs on global rank 0 only)."""
        return nullcontext()

    def seed_layers(self, sequential: nn.Sequential, plan: StagePlan, *, seed: Optional[int] = None) -> None:
        """Gives the plan's layers their random streams; :meth:`build` calls it before anything else
        wraps the layers' forward, then hands the streams to the built stages (:meth:`use_layer_streams`)."""
        self.layer_rng.start(seed)
        devices = [plan.devices[j] for j, (a, b) in enumerate(plan.ranges) for _ in range(a, b)]
        self.layer_rng.attach(list(sequential), devices)

    def use_layer_streams(self, stages: Sequence[Stage]) -> None:
        """Stages holding a seeded layer run their micro-batches in the streams; the others need
        not pay for entering them. Layers that no stage of this process holds (another rank's)
        are released: they never run here."""
        held = {id(m) for stage in stages for m in stage.partition.modules()}
        self.layer_rng.release([layer for layer in self.layer_rng.seeded_layers if id(layer) not in held])
        seeded = {id(layer) for layer in self.layer_rng.seeded_layers}
        for stage in stages:
            mine = any(id(m) in seeded for m in stage.partition.modules())
            stage.streams = self.layer_rng if mine else None

    # -- processes and devices ----------------------------------------------------------

    def configure_world(self, world: World) -> None:
        """The world is known (the Trainer is being built): check the topology against it."""

    def launcher(self, environment: ClusterEnvironment, world: World) -> Optional[Any]:
        """The Lightning launcher that starts this node's processes, or None."""
        return None

    def connect(self, environment: ClusterEnvironment, device: torch.device) -> None:
        """Set up process groups (called in ``setup_environment``)."""

    @property
    def device_mesh(self) -> Optional[Any]:
        """The processes' ``DeviceMesh`` once connected (the module's ``self.device_mesh``), or None."""
        return None

    def root_device(self, devices: Sequence[torch.device], local_rank: int) -> torch.device:
        """Where the module's loss and the parts outside the pipeline live."""
        if self.plan is not None:
            return self.plan.devices[-1]
        s = self.settings
        if s.placement is not None:
            return devices[s.placement[-1] % len(devices)]
        used = s.stage_count or len(devices)
        return devices[min(used, len(devices)) - 1]

    def sampler_kwargs(self, global_rank: int) -> Dict[str, Any]:
        """``num_replicas`` and ``rank`` of this process's share of the data."""
        return {"num_replicas": 1, "rank": 0}

    def check_module(self, module: LightningModule, precision: Any) -> None:
        """Refuse a module or precision this engine cannot run, before anything is built."""

    # -- building -------------------------------------------------------------------

    @abstractmethod
    def build(
        self, module: LightningModule, sequential: nn.Sequential, devices: Sequence[torch.device]
    ) -> None:
        """Plan the stages of ``sequential`` (the module's own) and build this process's."""

    @property
    @abstractmethod
    def stages(self) -> List[Stage]:
        """This process's stages."""

    def place(self, module: LightningModule, root_device: torch.device) -> None:
        """Each stage to its device; the rest of the module to ``root_device`` (but what this
        process does not hold, on the meta device)."""
        assert self.sequential is not None
        inside = {id(m) for m in self.sequential.modules()}
        for m in module.modules():
            if id(m) not in inside:
                apply_to_tensors(m, lambda t: t if t.is_meta else t.to(root_device), recurse=False)
        for stage in self.stages:
            stage.to(stage.device)
        set_module_device(module, root_device)

    # -- one step -------------------------------------------------------------------

    @abstractmethod
    def run(self, hook: str, module: LightningModule, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Run the module's ``hook`` (``training_step``, ...) on one batch through the pipeline."""

    def take_step_gradients(self) -> None:
        """When ``backward_in_step``: add the gradients :meth:`run` computed to ``.grad``."""

    def total_norm(self, grads: List[Tensor], device: torch.device) -> Tensor:
        """The 2-norm of the whole model's gradients, for clipping by norm."""
        if not grads:
            return torch.zeros((), device=device)
        return torch.nn.utils.get_total_norm(grads).float().to(device)

    # -- state ----------------------------------------------------------------------

    def module_state_dict(self, module: LightningModule) -> Dict[str, Any]:
        return module.state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        return optimizer.state_dict()

    def rng_states(self) -> List[Dict[str, Any]]:
        """Every rank's RNG states, in rank order (one process: one)."""
        return [_rng.collect()]

    def my_rng_state(self, by_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
        """This process's entry of :meth:`rng_states` as saved (rank 0's when the world changed)."""
        return by_rank[0]

    def save_checkpoint(
        self,
        checkpoint: Dict[str, Any],
        path: Any,
        io: CheckpointIO,
        storage_options: Optional[Any],
        is_zero: bool,
    ) -> None:
        if is_zero:
            io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, io: CheckpointIO, weights_only: Optional[bool]) -> Dict[str, Any]:
        """A single file (either engine's ``torch.save``) or a sharded directory (the distributed
        engine's): both hold the unpipelined module's keys."""
        if sharded.is_sharded(path) or os.path.isdir(path):  # an incomplete one is named by sharded.load
            return sharded.load(path, weights_only=weights_only)
        return safe_load.load_with(io, path, weights_only)

    def load_module_state_dict(self, module: LightningModule, state: Dict[str, Any], strict: bool) -> None:
        module.load_state_dict(state, strict=strict)

    def load_optimizer_state(self, optimizer: Optimizer, state: Dict[str, Any]) -> None:
        optimizer.load_state_dict(self._by_index(optimizer, state))

    def _by_index(self, optimizer: Optimizer, state: Dict[str, Any]) -> Dict[str, Any]:
        """Optimizer state at torch's indices; a sharded checkpoint keys it by parameter name."""
        if not any(isinstance(k, str) for k in state["state"]):
            return state
        assert self.module is not None, "optimizer state is restored after build()"
        return sharded.optimizer_state_by_index(state, optimizer_param_names(self.module, optimizer))

    # -- failures and the end -----------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        """A step failed; say what is known before Lightning unwinds."""

    def teardown(self, module: Optional[LightningModule]) -> None:
        """The module becomes an ordinary module again, on the CPU."""
        self.layer_rng.detach()
        if self.sequential is not None:
            self.sequential.__dict__.pop("forward", None)
            uncompile_layers(self.sequential)
        if module is not None:
            apply_to_tensors(module, lambda t: t if t.is_meta else t.cpu())
            set_module_device(module, torch.device("cpu"))
