"""The distributed engine: one process per pipeline rank, on ``torch.distributed.pipelining``.

The world is ``pp x dp`` processes on a 2-D ``DeviceMesh`` ``("dp", "pp")``
(:mod:`~pipeckpt.engines.topology`). A pipeline rank holds ``virtual_stages``
stages of the same :class:`~pipeckpt.planning.StagePlan` the local engine
builds, each wrapped in the same :class:`~pipeckpt.stage.Stage`, so a checkpoint
mode means the same under both engines. torch's GPipe, 1F1B or interleaved
1F1B schedule drives the stages (:mod:`~pipeckpt.engines.pipelining`); the
user's unchanged step is routed through it (:mod:`~pipeckpt.engines.routing`).
Replicas average gradients with DDP over the ``dp`` group, one DDP per stage,
which the schedule drives (no reduction before the last micro-batch's backward).

The layers of stages held elsewhere move to the meta device: the module keeps
its structure and every parameter keeps its place in the optimizer, so model
and optimizer state dicts keep the local engine's keys and indices. Saving
gathers the owners' entries on global rank 0; a resume gives each rank its
own. Checkpoints move freely between the engines.

One training step::

    training_step(batch)             every rank: the batch's m micro-batches
      schedule.step                  first stage: user's step up to its Sequential call -> input
        loss_fn(output_i, i)         last stage: user's step with the Sequential answering output_i
                                     -> loss_i / (m * accumulate_grad_batches); backward by the schedule
      broadcast from the last stage  mean loss and reduced self.log calls, replayed on every rank
    backward(loss)                   adds the step's gradients (Lightning zeroes them in between)
    optimizer.step()                 clipping by norm uses the norm over the whole pipeline
"""

import os
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils._pytree import tree_map
from typing_extensions import override

from pipeckpt import _rng
from pipeckpt._errors import PipeckptWarning, config_error
from pipeckpt.batch_norm import convert_deferred_batch_norm
from pipeckpt.contract import pipelined_sequential
from pipeckpt.engines.liveness import Liveness, is_communication_failure, lost_message
from pipeckpt.engines.pipelining import LiveStage, Schedules, StageModule, shape_inference_loss
from pipeckpt.engines.routing import LogRecorder, Microbatches, answering, capture_input, replay, step_loss
from pipeckpt.engines.topology import Topology, microbatches_for, resolve, validate_settings
from pipeckpt.planning import StagePlan, plan, split
from pipeckpt.stage import Stage, capture_caller_state
from pipeckpt.strategy import PipelineStrategy, _optimizer_state_to_param_devices, _warn_if_slurm_ignored

__all__ = ["DistributedPipelineStrategy"]

_RNG_BY_RANK = "pipeckpt_rng_states_by_rank"


@dataclass
class _Run:
    """One call of the user's hook in flight through the schedule."""

    hook: str
    microbatches: Microbatches
    rest: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    last: Optional[LiveStage]
    scale: float = 1.0
    recorder: LogRecorder = field(init=False)
    losses: List[Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.recorder = LogRecorder(self.hook)


class DistributedPipelineStrategy(PipelineStrategy):
    """One process per pipeline rank (see the module docstring). Built by
    ``PipelineStrategy(engine="distributed", ...)``; its own arguments:

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        dp: replicas of the whole pipeline; default ``world // (stages // virtual_stages)``,
            or 1 when the stage count is not set (one stage per process).
        virtual_stages: stages per process (``interleaved_1f1b`` only).
        timeout: seconds a collective may wait before the run fails.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs["engine"] = "distributed"
        super().__init__(**kwargs)
        validate_settings(
            schedule=self.schedule, virtual_stages=self.virtual_stages, dp=self.dp, timeout=self.timeout
        )
        self._topology: Optional[Topology] = None
        self._pp_group: Optional[dist.ProcessGroup] = None
        self._dp_group: Optional[dist.ProcessGroup] = None
        self._modules: List[StageModule] = []
        self._schedules: Optional[Schedules] = None
        self._run: Optional[_Run] = None
        self._step_gradients: List[Tuple[nn.Parameter, Tensor]] = []
        self._liveness: Optional[Liveness] = None
        self._warned_microbatches = False

    # -- topology -----------------------------------------------------------------

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            return torch.device("cpu")
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def topology(self) -> Topology:
        """``pp`` x ``dp`` and who runs which stage, from the settings and the world size."""
        if self._topology is None:
            self._topology = resolve(
                world=max(1, self.num_nodes * self.num_processes),
                virtual_stages=self.virtual_stages,
                stages=self.num_stages if self.balance is None else len(self.balance),
                dp=self.dp,
                chunks=self.chunks,
                schedule=self.schedule,
            )
        return self._topology

    @property
    def pipeline_size(self) -> int:
        """``pp``: processes in one pipeline."""
        return self.topology.pp

    @property
    def data_parallel_size(self) -> int:
        """``dp``: replicas of the whole pipeline."""
        return self.topology.dp

    @property
    def pipeline_rank(self) -> int:
        return self.global_rank % self.pipeline_size

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank // self.pipeline_size

    @property
    @override
    def stages(self) -> List[Stage]:
        """This process's stages; the others live in other processes."""
        return [m.stage for m in self._modules]

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        # All ranks of one pipeline see the same batch; replicas see different ones.
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @override
    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self._topology = None
        if self.num_processes:  # bad settings fail when the Trainer is built
            self._topology = self.topology

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        _warn_if_slurm_ignored(self.cluster_environment)
        _check_slurm_tasks(self.cluster_environment, devices=self.num_processes, num_nodes=self.num_nodes)
        self._launcher = _SubprocessScriptLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes
        )

    @override
    def setup_environment(self) -> None:
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        reset_seed()
        self.set_world_ranks()
        device = self.root_device
        options: Dict[str, Any] = {"timeout": timedelta(seconds=self.timeout)}
        if device.type != "cpu":
            options["device_id"] = device
        _init_dist_connection(
            self.cluster_environment, _get_default_process_group_backend_for_device(device), **options
        )
        mesh = init_device_mesh(
            device.type, (self.data_parallel_size, self.pipeline_size), mesh_dim_names=("dp", "pp")
        )
        self._pp_group, self._dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        self._liveness = Liveness(
            dist.distributed_c10d._get_default_store(), rank=self.global_rank, world_size=self.world_size
        )
        self._liveness.start()

    # -- set-up -----------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise config_error(
                f"{type(module).__name__} uses manual optimization",
                "the distributed engine's schedule runs backward itself, inside training_step",
                "use automatic optimization, or engine='local'",
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise config_error(
                "precision='16-mixed' (a gradient scaler)",
                "the schedule runs backward inside training_step, where the scaler cannot scale it",
                "use precision='bf16-mixed' or '32-true' with the distributed engine",
            )
        self.model = self.precision_plugin.convert_module(self.model)
        self._build_pipeline()
        self.model_to_device()
        assert self._plan is not None and self._pp_group is not None
        self._schedules = Schedules(
            kind=self.schedule,
            indices=[m.stage.index for m in self._modules],
            modules=self._modules,
            trained=[self._data_parallel(m) for m in self._modules],
            num_stages=self._plan.stages,
            device=self.root_device,
            group=self._pp_group,
            loss_fn=self._microbatch_loss,
        )
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._route_gradient_clipping()

    @override
    def _plan_for(
        self, module: LightningModule, sequential: nn.Sequential, balance: Optional[Tuple[int, ...]] = None
    ) -> StagePlan:
        if self.placement is not None:
            raise config_error(
                f"placement={self.placement} with engine='distributed'",
                "each process runs its stages on its own device",
                "drop `placement`",
            )
        return plan(
            sequential,
            devices=[self.root_device],
            stages=self.topology.stages,
            balance=balance if balance is not None else self.balance,
            balance_by=self.balance_by,
            checkpoint=self.checkpoint,
            sample=getattr(module, "example_input_array", None),
            chunks=self.chunks,
        )

    @override
    def _build_pipeline(self) -> None:
        module = self.lightning_module
        assert module is not None
        sequential = pipelined_sequential(module)
        _check_all_parameters_pipelined(module, sequential)
        stage_plan = self._plan_for(module, sequential)
        agreed = [stage_plan.balance]  # a profiled balance may differ between processes
        dist.broadcast_object_list(agreed, src=0)
        if tuple(agreed[0]) != stage_plan.balance:
            stage_plan = self._plan_for(module, sequential, balance=tuple(agreed[0]))
        self._plan = stage_plan
        if self.deferred_batch_norm:
            convert_deferred_batch_norm(sequential, self.chunks)
        mine = self.topology.stages_of(self.global_rank)
        parts = split(sequential, stage_plan.balance)
        for j, part in enumerate(parts):
            if j not in mine:
                part.to_empty(device="meta")  # another rank's: keep the structure, free the memory
        self._modules = [
            StageModule(
                Stage(
                    parts[j],
                    index=j,
                    mode=stage_plan.modes[j],
                    device=self.root_device,
                    pin_memory=self.pin_memory,
                ),
                entry=self._first_stage_input if j == 0 else None,
            )
            for j in mine
        ]
        sequential.forward = _called_outside_a_step  # type: ignore[method-assign]
        self._sequential = sequential

    def _data_parallel(self, module: StageModule) -> nn.Module:
        if self.data_parallel_size == 1 or not any(p.requires_grad for p in module.parameters()):
            return module
        device = self.root_device
        ddp = DistributedDataParallel(
            module,
            process_group=self._dp_group,
            broadcast_buffers=False,
            device_ids=None if device.type == "cpu" else [device],
        )
        # The schedule arms DDP's reducer itself before the last micro-batch's backward.
        # Any other forward, such as the schedule's shape inference, must not arm it.
        ddp.require_backward_grad_sync = False
        return ddp

    @override
    def model_to_device(self) -> None:
        module = self.lightning_module
        assert module is not None
        device = self.root_device
        module._apply(lambda t: t if t.is_meta else t.to(device))
        module._device = device

    # -- the step ---------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._pipelined("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._pipelined("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._pipelined("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._pipelined("predict_step", args, kwargs)

    def _pipelined(self, hook: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        module, sequential, schedules = self.lightning_module, self._sequential, self._schedules
        assert module is not None and sequential is not None and schedules is not None and args
        train = hook == "training_step"
        batch, rest = args[0], args[1:]
        m = self._microbatches_for(Microbatches(batch, 1).size, train)
        microbatches = Microbatches(batch, m)
        schedule, stages = schedules.get(train=train, microbatches=m, signature=microbatches.signature())
        last = next((s for s in stages if s.is_last), None)
        run = _Run(hook, microbatches, rest, kwargs, last)
        if train:
            run.scale = 1.0 / (m * module.trainer.accumulate_grad_batches)
        caller = capture_caller_state()
        for stage_module in self._modules:
            stage_module.stage.begin_step(m, caller)
        inputs = microbatches.tensors if any(s.is_first for s in stages) else ()
        result = None
        self._run = run
        try:
            if train:
                with self._gradients_set_aside():
                    schedule.step(
                        *inputs, target=torch.arange(m) if last is not None else None, return_outputs=False
                    )
            else:
                output = schedule.step(*inputs)
                if last is not None:  # forward only: the step sees the whole batch's output
                    with answering(module, sequential, output, hook, run.recorder):
                        result = getattr(module, hook)(batch, *rest, **kwargs)
        finally:
            self._run = None
            for stage in stages:
                stage.last_output = None
        payload = None
        if last is not None:
            payload = {
                "logs": run.recorder.reduced(),
                "loss": torch.stack(run.losses).mean().cpu() if train else None,
                "prediction": _to_cpu(result) if hook == "predict_step" else None,
            }
        payload = self._from_last_stage(payload)
        replay(module, payload["logs"], self.root_device)
        if train:
            return payload["loss"].to(self.root_device)
        return payload["prediction"] if hook == "predict_step" else result

    def _first_stage_input(self, tensors: Tuple[Tensor, ...]) -> Tensor:
        run, module, sequential = self._run, self.lightning_module, self._sequential
        assert run is not None and module is not None and sequential is not None
        return capture_input(
            module, sequential, run.hook, run.microbatches.rebuild(tensors), run.rest, run.kwargs
        )

    def _microbatch_loss(self, output: Any, target: Tensor) -> Tensor:
        """The schedule's ``loss_fn`` on the last stage: the user's step on micro-batch ``target``."""
        run, module, sequential = self._run, self.lightning_module, self._sequential
        assert run is not None and module is not None and sequential is not None
        if run.last is None or not run.last.ran(output):
            return shape_inference_loss(output)
        with answering(module, sequential, output, run.hook, run.recorder):
            returned = module.training_step(run.microbatches[int(target[0])], *run.rest, **run.kwargs)
        loss = step_loss(returned, run.hook)
        run.losses.append(loss.detach().float())
        return loss * run.scale

    def _microbatches_for(self, size: int, train: bool) -> int:
        m = microbatches_for(
            size, chunks=self.chunks, schedule=self.schedule, pp=self.pipeline_size, train=train
        )
        if m != self.chunks and not self._warned_microbatches:
            self._warned_microbatches = True
            rank_zero_warn(
                f"a batch of {size} samples cannot be cut into chunks={self.chunks} equal "
                f"micro-batches; it runs as {m} micro-batches (typically the last, smaller batch "
                "of an epoch). HINT: use a batch size that is a multiple of chunks, or "
                "drop_last=True",
                category=PipeckptWarning,
            )
        return m

    def _from_last_stage(self, payload: Any) -> Any:
        if self.pipeline_size == 1:
            return payload
        box = [payload]
        src = dist.get_global_rank(self._pp_group, self.pipeline_size - 1)
        dist.broadcast_object_list(box, src=src, group=self._pp_group)
        return box[0]

    @contextmanager
    def _gradients_set_aside(self) -> Iterator[None]:
        """The schedule runs backward inside ``training_step``, but Lightning zeroes
        gradients between ``training_step`` and ``backward``: the step's gradients
        wait here, and :meth:`backward` adds them as a backward would."""
        params = [p for m in self._modules for p in m.parameters() if p.requires_grad]
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            self._step_gradients = [(p, p.grad) for p in params if p.grad is not None]
            for p, g in zip(params, held):
                p.grad = g

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
    ) -> Tensor:
        """Adds the gradients the schedule computed in ``training_step``, between the hooks."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, g in self._step_gradients:
            p.grad = g if p.grad is None else p.grad.add_(g)
        self._step_gradients = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _route_gradient_clipping(self) -> None:
        """Clipping by norm needs the norm of the whole model, spread over the pipeline."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
            params = [p for p in plugin.main_params(optimizer) if p.grad is not None]
            norm = (
                torch.nn.utils.get_total_norm([p.grad for p in params]).float()
                if params
                else torch.zeros((), device=self.root_device)
            )
            squared = norm.to(self.root_device) ** 2
            if self.pipeline_size > 1:  # replicas hold the same, DDP-averaged, gradients
                dist.all_reduce(squared, group=self._pp_group)
            torch.nn.utils.clip_grads_with_norm_(params, clip_val, squared.sqrt())

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    # -- checkpoints ----------------------------------------------------------------

    def _gathered_on_zero(self, piece: Any) -> Optional[List[Any]]:
        """Every rank's ``piece`` on global rank 0 (a collective), else None."""
        pieces = [None] * self.world_size if self.is_global_zero else None
        dist.gather_object(piece, pieces, dst=0)
        return pieces

    def _set_up(self) -> bool:
        return self._pp_group is not None and dist.is_initialized()

    @override
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """The whole model's state dict on global rank 0, under the module's own keys."""
        module = self.lightning_module
        assert module is not None
        state = module.state_dict()
        if not self._set_up():
            return state
        mine = None
        if self.data_parallel_rank == 0:
            mine = {k: _to_cpu(v) for k, v in state.items() if not (isinstance(v, Tensor) and v.is_meta)}
        pieces = self._gathered_on_zero(mine)
        if pieces is None:
            return state
        merged: Dict[str, Any] = OrderedDict()
        for key in state:
            merged[key] = next(p[key] for p in pieces if p is not None and key in p)
        return merged

    @override
    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """The state for every parameter on global rank 0, at the indices of the whole
        model's optimizer: each rank holds the entries of its own parameters."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        state = optimizer.state_dict()
        if not self._set_up():
            return state
        pieces = self._gathered_on_zero(_to_cpu(state["state"]) if self.data_parallel_rank == 0 else None)
        if pieces is None:
            return state
        merged: Dict[int, Any] = {}
        for piece in pieces:
            merged.update(piece or {})
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}

    @override
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        # Every rank draws its own dropout masks: a resume on the same world restores each
        # rank's RNG, where the base class restores global rank 0's everywhere.
        if self._set_up():
            by_rank = self._gathered_on_zero(_rng.collect())
            if by_rank is not None:
                checkpoint[_RNG_BY_RANK] = by_rank
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        by_rank = checkpoint.get(_RNG_BY_RANK)
        if by_rank is not None and len(by_rank) == self.world_size:
            _rng.restore(by_rank[self.global_rank])
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Dict[str, Any]) -> None:
        for optimizer, full in zip(self.optimizers, checkpoint["optimizer_states"]):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            mine = {i: s for i, s in full["state"].items() if i < len(params) and not params[i].is_meta}
            optimizer.load_state_dict({"state": mine, "param_groups": full["param_groups"]})
            _optimizer_state_to_param_devices(optimizer)

    # -- collectives --------------------------------------------------------------

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @override
    def reduce(
        self,
        tensor: Any,
        group: Optional[Any] = None,
        reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean",
    ) -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return ParallelStrategy.all_gather(self, tensor, group=group, sync_grads=sync_grads)

    # -- failures and the end ---------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        liveness = self._liveness
        if liveness is None:
            return
        liveness.leaving()
        if not is_communication_failure(exception):
            return
        lost = _exited_children(self) or liveness.lost_ranks()
        message = lost_message(
            me=self.global_rank, lost=lost, describe=self.topology.describe, timeout=self.timeout
        )
        print(message, flush=True)  # at once: a launcher may kill this process before it unwinds
        exception.args = (f"{message}\n{exception.args[0] if exception.args else ''}", *exception.args[1:])

    @override
    def teardown(self) -> None:
        if self._liveness is not None:
            self._liveness.stop()
            self._liveness = None
        if self._schedules is not None:
            self._schedules.clear()
        self._run = None
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        if self._sequential is not None:
            self._sequential.__dict__.pop("forward", None)
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        module = self.lightning_module
        if module is not None:
            module._apply(lambda t: t if t.is_meta else t.cpu())
            module._device = torch.device("cpu")
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def _check_all_parameters_pipelined(module: LightningModule, sequential: nn.Sequential) -> None:
    inside = {id(p) for p in sequential.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        shown = ", ".join(outside[:3]) + (", ..." if len(outside) > 3 else "")
        raise config_error(
            f"trainable parameters outside the pipelined Sequential ({shown})",
            "under the distributed engine each process holds only its stages, so a parameter "
            "outside them would have no owner",
            "move those layers into the Sequential returned by configure_pipeline(), or use engine='local'",
        )


def _called_outside_a_step(*args: Any, **kwargs: Any) -> Any:
    raise config_error(
        "the pipelined Sequential was called outside training/validation/test/predict_step",
        "under the distributed engine each process holds only its stages, so the Sequential "
        "runs only inside a step, through the schedule",
        "call it from a step, or use engine='local'",
    )


def _check_slurm_tasks(environment: Any, *, devices: int, num_nodes: int) -> None:
    if not isinstance(environment, SLURMEnvironment):
        return
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    count = per_node.split("(")[0]  # "2(x3)": 2 tasks on each of 3 nodes
    if count.isdigit() and int(count) != devices:
        raise config_error(
            f"devices={devices} with SLURM --ntasks-per-node={per_node}",
            "the distributed engine runs one process per device, and SLURM starts "
            "--ntasks-per-node of them on each node, so the two must agree",
            f"set the trainer's devices={count} (pp x dp = {int(count) * num_nodes} processes "
            f"on {num_nodes} node(s)), or change --ntasks-per-node",
        )


def _exited_children(strategy: DistributedPipelineStrategy) -> List[int]:
    """Ranks that Lightning's launcher started from this process and that have exited."""
    procs = getattr(strategy.launcher, "procs", None) or []
    base = strategy.node_rank * strategy.num_processes
    return [base + i + 1 for i, proc in enumerate(procs) if proc.poll() is not None]


def _to_cpu(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, obj)
