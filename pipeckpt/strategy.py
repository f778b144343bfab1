"""The ``pipe`` Lightning strategy.

One process drives every stage (engine ``local``); ``engine="distributed"``
selects :class:`pipeckpt.engines.distributed.DistributedPipelineStrategy`,
one process per stage, through the same constructor.

What a pipeline changes in Lightning's single-process assumptions, and where
this class handles it:

- placement: stages live on their own devices, so ``model_to_device`` must not
  move the whole module to one device (:meth:`model_to_device`);
- the root device is the *last* stage's device: the loss, the targets and the
  module's non-pipelined parts meet the pipeline's output there, while the
  engine moves the pipeline input to the first stage;
- optimizer state follows each parameter's device, also after a resume;
- the user's Sequential keeps its place (its ``forward`` is routed through the
  engine), so checkpoints hold the unpipelined keys whatever the layout.
"""

import os
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from pipeckpt import _rng
from pipeckpt._compat import apply_to_tensors, set_module_device
from pipeckpt._errors import PipeckptWarning, config_error
from pipeckpt.batch_norm import convert_deferred_batch_norm
from pipeckpt.contract import pipelined_sequential
from pipeckpt.engines import ENGINES
from pipeckpt.engines.local_pipeline import LocalPipeline
from pipeckpt.modes import CheckpointMode, ModeSpec, parse_modes
from pipeckpt.planning import StagePlan, check_balance_by, plan
from pipeckpt.stage import Stage

__all__ = ["PipelineStrategy"]

_CKPT_KEY = "pipeckpt"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _validate_settings(
    *, stages: Optional[int], chunks: int, checkpoint: ModeSpec, balance_by: str, engine: str, schedule: str
) -> None:
    """Checks that need no model, so they fail when the strategy is built."""
    if not isinstance(chunks, int) or chunks < 1:
        raise config_error(
            f"chunks={chunks!r}",
            "the number of micro-batches must be an integer >= 1",
            "set chunks to 1 (no micro-batching) or more",
        )
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise config_error(
            f"stages={stages!r}",
            "a pipeline needs an integer number of stages >= 1",
            "set stages >= 1, or leave it unset to use one stage per device",
        )
    if engine not in ENGINES:
        raise config_error(
            f"engine={engine!r}",
            f"must be one of {ENGINES}",
            "use 'local' (one process) or 'distributed' (one process per stage)",
        )
    if schedule not in SCHEDULES:
        raise config_error(
            f"schedule={schedule!r}", f"must be one of {SCHEDULES}", "choose one of those schedules"
        )
    check_balance_by(balance_by)
    names = [checkpoint] if isinstance(checkpoint, (str, CheckpointMode)) else list(checkpoint)
    parse_modes(names, len(names))  # unknown names fail now; the length is checked per plan


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


class PipelineStrategy(ParallelStrategy):
    """GPipe pipeline parallelism with a checkpoint mode per stage.

    Args:
        stages: number of stages; default one per device (all on one device on CPU).
        balance: layers per stage, e.g. ``[3, 3, 3, 3]``; default automatic.
        balance_by: automatic balance by ``"params"``, or by profiled ``"time"`` or
            ``"memory"`` (CUDA) of the module's ``example_input_array``.
        chunks: micro-batches per mini-batch; their gradients accumulate into one step.
        checkpoint: one mode for every stage, or a list with one per stage:
            ``never``, ``except_last``, ``always``, ``offload``.
        placement: device index of each stage, to put several stages on one device.
        deferred_batch_norm: BatchNorm statistics per mini-batch, not per micro-batch.
        pin_memory: ``offload`` keeps stage inputs in pinned host memory (CUDA only).
        engine: ``"local"`` (one process, torchgpipe) or ``"distributed"``.
        schedule, dp, virtual_stages, timeout: distributed engine settings.
    """

    strategy_name = "pipe"

    def __new__(cls, *args: Any, engine: str = "local", **kwargs: Any) -> "PipelineStrategy":
        if cls is PipelineStrategy and engine == "distributed":
            from pipeckpt.engines.distributed import DistributedPipelineStrategy

            return super().__new__(DistributedPipelineStrategy)
        return super().__new__(cls)

    def __init__(
        self,
        *,
        stages: Optional[int] = None,
        balance: Optional[Sequence[int]] = None,
        balance_by: str = "params",
        chunks: int = 1,
        checkpoint: ModeSpec = "except_last",
        placement: Optional[Sequence[int]] = None,
        deferred_batch_norm: bool = False,
        pin_memory: bool = True,
        engine: str = "local",
        schedule: str = "gpipe",
        dp: Optional[int] = None,
        virtual_stages: int = 1,
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _validate_settings(
            stages=stages,
            chunks=chunks,
            checkpoint=checkpoint,
            balance_by=balance_by,
            engine=engine,
            schedule=schedule,
        )
        self.num_stages = stages
        self.balance = list(balance) if balance is not None else None
        self.balance_by = balance_by
        self.chunks = chunks
        self.checkpoint = checkpoint if isinstance(checkpoint, (str, CheckpointMode)) else list(checkpoint)
        self.placement = list(placement) if placement is not None else None
        self.deferred_batch_norm = deferred_batch_norm
        self.pin_memory = pin_memory
        self.engine = engine
        self.schedule = schedule
        self.dp = dp
        self.virtual_stages = virtual_stages
        self.timeout = timeout
        self.num_nodes = 1
        self._plan: Optional[StagePlan] = None
        self._engine: Optional[LocalPipeline] = None
        self._sequential: Optional[nn.Sequential] = None

    # -- topology ---------------------------------------------------------------

    @property
    def plan(self) -> Optional[StagePlan]:
        """The stage plan, once :meth:`setup` has seen the module."""
        return self._plan

    @property
    def stages(self) -> List[Stage]:
        return self._engine.stages if self._engine is not None else []

    @property
    @override
    def root_device(self) -> torch.device:
        if self._plan is not None:
            return self._plan.devices[-1]
        devices = self.parallel_devices or [torch.device("cpu")]
        if self.placement is not None:
            return devices[self.placement[-1] % len(devices)]
        used = len(self.balance) if self.balance is not None else (self.num_stages or len(devices))
        return devices[min(used, len(devices)) - 1]

    @property
    def is_distributed(self) -> bool:
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    # -- set-up -----------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        _warn_if_slurm_ignored(self.cluster_environment)
        super()._configure_launcher()

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self._build_pipeline()
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            self._optimizers_to_param_devices()

    def _plan_for(self, module: LightningModule, sequential: nn.Sequential) -> StagePlan:
        return plan(
            sequential,
            devices=self.parallel_devices or [torch.device("cpu")],
            stages=self.num_stages,
            balance=self.balance,
            balance_by=self.balance_by,
            checkpoint=self.checkpoint,
            placement=self.placement,
            sample=getattr(module, "example_input_array", None),
            chunks=self.chunks,
        )

    def _build_pipeline(self) -> None:
        module = self.lightning_module
        assert module is not None
        sequential = pipelined_sequential(module)
        self._plan = self._plan_for(module, sequential)
        if self.deferred_batch_norm:
            convert_deferred_batch_norm(sequential, self.chunks)
        self._engine = LocalPipeline(sequential, self._plan, chunks=self.chunks, pin_memory=self.pin_memory)
        # The user's Sequential keeps its place in the module; only its call is routed.
        sequential.forward = self._engine.forward  # type: ignore[method-assign]
        self._sequential = sequential

    @override
    def model_to_device(self) -> None:
        """Each stage to its device, everything else of the module to the root device."""
        module, seq = self.lightning_module, self._sequential
        assert module is not None and seq is not None and self._engine is not None
        inside = {id(m) for m in seq.modules()}
        for m in module.modules():
            if id(m) not in inside:
                apply_to_tensors(m, lambda t: t.to(self.root_device), recurse=False)
        self._engine.place()
        set_module_device(module, self.root_device)

    def _optimizers_to_param_devices(self) -> None:
        """Lightning moves optimizer state to one root device; here it follows its parameter."""
        for optimizer in self.optimizers:
            _optimizer_state_to_param_devices(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Dict[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
            _optimizer_state_to_param_devices(optimizer)

    # -- checkpoints ----------------------------------------------------------------
    # Keys need no translation: the user's Sequential never moved. The RNG states
    # ride along so that a resumed run draws the same dropout masks as an
    # uninterrupted one (Lightning does not save them). Writing stays Lightning's
    # atomic save (an fsspec transaction: temporary file, then move).

    @override
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        checkpoint[_CKPT_KEY] = {
            "rng_states": _rng.collect(),
            "balance": list(self._plan.balance) if self._plan else None,
        }
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.get(_CKPT_KEY)
        if state is not None:
            _rng.restore(state["rng_states"])
        return checkpoint

    @override
    def teardown(self) -> None:
        if self._sequential is not None:
            # Back to a plain Sequential: after fit the module is an ordinary module again.
            self._sequential.__dict__.pop("forward", None)
        super().teardown()

    # -- one process: collectives are identities ---------------------------------

    @override
    def reduce(self, tensor: Union[Tensor, Any], *args: Any, **kwargs: Any) -> Union[Tensor, Any]:
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="GPipe pipeline with per-stage activation checkpointing"
        )


def _optimizer_state_to_param_devices(optimizer: Optimizer) -> None:
    for param, state in optimizer.state.items():
        for key, value in state.items():
            # Scalar 'step' counters stay where the optimizer keeps them (CPU by design).
            if isinstance(value, Tensor) and key != "step":
                state[key] = value.to(param.device)


def register() -> None:
    """Makes ``Trainer(strategy="pipe")`` work; safe to call more than once."""
    if PipelineStrategy.strategy_name not in StrategyRegistry:
        PipelineStrategy.register_strategies(StrategyRegistry)
