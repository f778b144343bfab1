"""The ``pipe`` Lightning strategy: the Lightning side of a pipeline, once, for every engine.

An engine (:mod:`pipeckpt.engines`, chosen by name, driven through the protocol of
:mod:`pipeckpt.engines.base`; this class never branches on it) runs the stages. What stays here
is what a pipeline changes in Lightning's assumptions: the module is never moved to one device
as a whole, the root device is where the loss meets the pipeline's output, optimizer state
follows each parameter's device (also after a resume), and checkpoints hold the unpipelined
module's keys plus every rank's RNG state, so a resumed run draws the same dropout masks.
"""

import os
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from pipeckpt import _rng
from pipeckpt._compat import (
    LightningPath,
    checkpoint_io_unset,
    give_device_mesh,
    optimizers_to_device,
    sigterm_broadcast,
    unwrap_optimizer,
)
from pipeckpt._errors import PipeckptConfigError, PipeckptWarning
from pipeckpt.boundaries.contract import pipelined_sequential
from pipeckpt.engines import engine_class
from pipeckpt.engines.base import Engine
from pipeckpt.settings import PipeSettings, PipeSettingsArgs, check_names
from pipeckpt.stages.partition import StagePlan
from pipeckpt.stages.stage import Stage
from pipeckpt.state import preemption, termination
from pipeckpt.state.files import AtomicCheckpointIO
from pipeckpt.state.fit import check_fits
from pipeckpt.strategy_layout import replica_share, searched_later, searching_launcher
from pipeckpt.strategy_meta import MetaBuildStrategy
from pipeckpt.weights.pretrained import marked_in

__all__ = ["PipelineStrategy"]

_CKPT_KEY = "pipeckpt"


class PipelineStrategy(MetaBuildStrategy):
    """Pipeline parallelism with a checkpoint mode per stage.

    Args:
        settings: every field of :class:`pipeckpt.settings.PipeSettings` by name (``stages``,
            ``balance``, ``chunks``, ``checkpoint``, ``engine``, ...; docs/SETTINGS.md lists them).
        cluster: the devices ``layout="auto"`` searches for (:mod:`pipeckpt.strategy_layout`).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            Lightning's own strategy arguments.
    """

    strategy_name = "pipe"

    def __init__(
        self,
        *,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        cluster: Optional[Any] = None,
        **settings: Unpack[PipeSettingsArgs],
    ) -> None:
        check_names(settings, "PipelineStrategy")
        self.settings, self.layout_search = searched_later(settings, cluster)
        engine = engine_class(self.settings.engine)
        engine.check_settings(self.settings)  # every check before any work
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.engine: Engine = engine(self.settings)
        self.num_nodes = 1
        self.auto_plan: Optional[Any] = None  # checkpoint='auto': pipeckpt.memory.budget.AutoPlan
        self._loaded_from: Optional[str] = None  # the checkpoint being restored, named in its errors

    # -- topology ---------------------------------------------------------------

    @property
    def plan(self) -> Optional[StagePlan]:
        """The stage plan, once :meth:`setup` has seen the module."""
        return self.engine.plan

    @property
    def stages(self) -> List[Stage]:
        """This process's stages."""
        return self.engine.stages

    # -- set-up -----------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        _warn_if_slurm_ignored(self.cluster_environment)
        if checkpoint_io_unset(self):  # neither the strategy nor plugins=[...] chose one
            # Written into the target directory and renamed: a kill never leaves half a checkpoint.
            self.checkpoint_io = AtomicCheckpointIO()
        launcher = self.engine.launcher(self.cluster_environment, self._world())
        self._launcher = searching_launcher(self, launcher)  # layout="auto": searched at the launch

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.engine.is_distributed:
            self.set_world_ranks()
            assert self.cluster_environment is not None
            self.engine.connect(self.cluster_environment, self.root_device)
            # Read in configure_model (self.device_mesh), as ModelParallelStrategy hands it.
            if self.lightning_module is not None:
                give_device_mesh(self.lightning_module, self.engine.device_mesh)
            # Not reseeded (DDP's way): each rank draws on from global rank 0's generators, as the local
            # engine's one process draws on from the script's (docs/DISTRIBUTED.md, "Random numbers").
            _rng.agree(self.root_device)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self.engine.check_module(module, self.precision_plugin)
        launched = getattr(self.launcher, "procs", None) or ()  # the ranks this process started
        with termination.stop_on_sigterm(self.global_rank, _loading(module), launched):
            self._materialize(module)
            self.model = self.precision_plugin.convert_module(self.model)
            if self.settings.modes == "auto":
                self._choose_plan(trainer, module)
            self.engine.build(
                module, pipelined_sequential(module), self.parallel_devices or [torch.device("cpu")]
            )
            self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            preemption.install(trainer, self.cluster_environment)  # SIGUSR1 answered at step boundaries
            answered = termination.install(trainer)  # SIGTERM too: a checkpoint, then a non-zero exit
            sigterm_broadcast(trainer, on=answered is None)  # Lightning's flag: 0 while ours answers
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:
                _optimizer_state_to_param_devices(optimizer)
        self._route_gradient_clipping()

    def _choose_plan(self, trainer: Trainer, module: Any) -> None:
        """``checkpoint='auto'``: the plan under ``memory_budget``, chosen once (on rank 0), which
        the engine adopts before it builds (:mod:`pipeckpt.memory.budget`)."""
        from pipeckpt.memory.budget import resolve_for

        chosen: List[Any] = [None]
        if self.global_rank == 0:
            try:
                chosen[0] = resolve_for(self.settings, module, trainer, self.parallel_devices, self.engine)
            except PipeckptConfigError as error:  # every rank raises rank 0's error, none waits
                chosen[0] = error
        plan = self.broadcast(chosen[0])
        if isinstance(plan, PipeckptConfigError):
            raise plan
        self.auto_plan = plan
        self.settings = plan.settings
        self.engine.adopt(plan.settings)
        rank_zero_info(plan.describe())

    @override
    def model_to_device(self) -> None:
        """Each stage to its device, everything else of the module to the root device."""
        assert self.lightning_module is not None
        self.engine.place(self.lightning_module, self.root_device)

    def _route_gradient_clipping(self) -> None:
        """Clipping by norm takes the norm of the whole model, which the engine may spread over processes."""
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = _clip_by_whole_norm(plugin, self.engine, self.root_device)  # type: ignore[method-assign]

    # -- the step ---------------------------------------------------------------

    def _step(self, hook: str, context: Any, args: Any, kwargs: Any) -> Any:
        args, kwargs = self.precision_plugin.convert_input((replica_share(self, hook, args), kwargs))
        assert self.lightning_module is not None
        with context():
            return self.engine.run(hook, self.lightning_module, args, kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
    ) -> Tensor:
        if not self.engine.backward_in_step:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The engine's schedule ran backward inside training_step; its gradients join
        # .grad here, between the hooks, where a backward would have put them.
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.engine.take_step_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # -- checkpoints ----------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        assert self.lightning_module is not None
        return self.engine.module_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        return self.engine.optimizer_state(unwrap_optimizer(optimizer))

    @override
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: LightningPath, storage_options: Optional[Any] = None
    ) -> None:
        checkpoint[_CKPT_KEY] = {
            "rng_states": self.engine.rng_states(),  # one per rank
            "balance": list(self.plan.balance) if self.plan else None,
            "layer_rng": self.engine.layer_rng.state_dict(),  # seed and training calls
        }
        self.engine.save_checkpoint(
            checkpoint, filepath, self.checkpoint_io, storage_options, self.is_global_zero
        )

    @override
    def load_checkpoint(
        self, checkpoint_path: LightningPath, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        torch.cuda.empty_cache()
        self._loaded_from = str(checkpoint_path)
        checkpoint = self.engine.load_checkpoint(checkpoint_path, self.checkpoint_io, weights_only)
        state = checkpoint.get(_CKPT_KEY)
        if state is not None:
            by_rank = state["rng_states"]
            _rng.restore(self.engine.my_rng_state(by_rank if isinstance(by_rank, list) else [by_rank]))
            if "layer_rng" in state:
                self.engine.layer_rng.load_state_dict(state["layer_rng"])
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        expected = self.engine.module_state_dict(self.lightning_module)
        check_fits(self.lightning_module, expected, checkpoint, strict=strict, source=self._loaded_from)
        self.engine.load_module_state_dict(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self.engine.load_optimizer_state(optimizer, state)
            _optimizer_state_to_param_devices(optimizer)

    # -- failures and the end ---------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, preemption.Preempted):
            return  # a planned exit on every rank at once, not a failure to explain
        self.engine.on_exception(exception)

    @override
    def teardown(self) -> None:
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        optimizers_to_device(self.optimizers, torch.device("cpu"))
        self.engine.teardown(self.lightning_module)  # the module is an ordinary module again, on the CPU
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Pipeline parallelism with per-stage activation checkpointing"
        )


# The signature tools read at run time (Hydra, help()): the settings' fields with their defaults.
PipelineStrategy.__signature__ = PipeSettings.signature()  # type: ignore[attr-defined]


def _loading(module: Any) -> str:
    """What :meth:`PipelineStrategy.setup` does to ``module``, for a SIGTERM's line."""
    sources = sorted({str(source.path) for _, source in marked_in(module)})
    read = f" (reading its pretrained weights from {', '.join(map(repr, sources))})" if sources else ""
    return f"loading the model{read}"


def _clip_by_whole_norm(plugin: Precision, engine: Engine, device: torch.device) -> Any:
    """``plugin``'s clip by norm, taking the norm of the whole model from ``engine``."""

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for p in plugin.main_params(optimizer) if p.grad is not None]
        norm = engine.total_norm([p.grad for p in params if p.grad is not None], device)
        by_mesh: Dict[Any, List[Tensor]] = {}  # one foreach per mesh: it takes no mix of DTensor meshes
        for p in params:
            by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
        for same in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(same, clip_val, norm)

    return clip_grad_by_norm


def _optimizer_state_to_param_devices(optimizer: Optimizer) -> None:
    """Lightning moves optimizer state to one root device; here it follows its parameter."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            # Scalar 'step' counters stay where the optimizer keeps them (CPU by design).
            if isinstance(value, Tensor) and key != "step":
                state[key] = value.to(param.device)


def _warn_if_slurm_ignored(environment: Optional[ClusterEnvironment]) -> None:
    """Lightning ignores SLURM in jobs named ``bash`` or ``interactive``; say so,
    since with several tasks each one then starts its own run and they hang."""
    name = os.environ.get("SLURM_JOB_NAME")
    if "SLURM_NTASKS" not in os.environ or name not in ("bash", "interactive"):
        return
    if isinstance(environment, SLURMEnvironment):  # the user passed plugins=[SLURMEnvironment()]
        return
    rank_zero_warn(
        f"SLURM_JOB_NAME={name!r}: Lightning ignores SLURM in a job named 'bash' or 'interactive' and"
        f" launches this node's processes itself, so each of the SLURM_NTASKS={os.environ['SLURM_NTASKS']}"
        " tasks starts a separate run (several tasks then hang waiting for each other)."
        " HINT: name the job (`sbatch -J pipeckpt`, `srun -J pipeckpt`), or start one task per node"
        " if you meant Lightning to launch the processes.",
        category=PipeckptWarning,
    )


def register() -> None:
    """Makes ``Trainer(strategy="pipe")`` work; safe to call more than once."""
    if PipelineStrategy.strategy_name not in StrategyRegistry:
        PipelineStrategy.register_strategies(StrategyRegistry)
