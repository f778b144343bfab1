"""Sharded data parallelism inside a stage: FSDP2's ``fully_shard`` over the mesh's ``dp`` dimension.

Why not DDP: every replica of a DDP stage holds its whole parameters, gradients and optimizer
state; under ``data_parallel='fsdp'`` each holds ``1/dp`` of them. Every layer of a stage that
trains parameters is sharded on its own (gathered for its forward), and the stage module is the
root, so ``torch.distributed.pipelining``'s stage sees an ``FSDPModule``: it holds the
reduce-scatter back until the step's last backward. Parameters become DTensors: the gradient
norm adds each rank's shard once, DCP writes the shards under the module's own keys, and a
checkpoint of any layout (full tensors) loads as this rank's shard of each tensor. Under tensor
parallelism the layers are split over ``tp`` first (:mod:`.tensor_parallel`), then sharded. Under
hybrid sharding (``dp_shard``) ``fully_shard`` takes the ``dp`` dimension split into a 2-D
``("dp_replicate", "dp_shard")`` mesh: FSDP2's own HSDP (shards within a group, all-reduced across).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from pipeckpt._compat import make_fsdp_root, split_mesh_dim
from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.kept_groups import kept
from pipeckpt.engines.distributed.tensor_parallel import TensorParallel
from pipeckpt.engines.distributed.ties import Replicas
from pipeckpt.settings import PipeSettings
from pipeckpt.weights.pretrained import pending_reads

__all__: List[str] = []

DATA_PARALLEL = ("ddp", "fsdp")


def check_data_parallel(s: PipeSettings) -> None:
    """``data_parallel`` names a kind this engine runs; ``reshard_after_forward`` and
    ``reduce_every_microbatch`` are FSDP's switches."""
    if s.data_parallel not in DATA_PARALLEL:
        raise config_error(
            f"data_parallel={s.data_parallel!r}",
            f"the replicas of a stage are kept by one of {list(DATA_PARALLEL)}: 'ddp' replicates "
            "parameters, gradients and optimizer state, 'fsdp' shards them over the replicas",
            "set data_parallel='ddp' (the default) or data_parallel='fsdp'",
        )
    switches = {
        "reshard_after_forward": "gathers parameters for a forward and frees them after",
        "reduce_every_microbatch": "reduce-scatters gradients into shards",
    }
    for name in switches:
        value = getattr(s, name)
        if value is not None and not isinstance(value, bool):
            raise config_error(
                f"{name}={value!r}", "is a switch: True or False", f"set {name}=True or {name}=False"
            )
    check_dp_shard(s)
    for name, what in switches.items():
        if getattr(s, name) and s.data_parallel != "fsdp":
            raise config_error(
                f"{name}=True with data_parallel={s.data_parallel!r}",
                f"only sharded data parallelism {what}",
                f"set data_parallel='fsdp', or drop {name}",
            )


def check_reduce_every(s: PipeSettings, split_backward: bool) -> None:
    """``reduce_every_microbatch`` lets FSDP2 reduce in each micro-batch's backward, which a
    zero-bubble schedule splits: its weight gradients are made in a later pass, after the backward
    FSDP2 reduces them in, so it keeps torch's one reduction at the step's end."""
    if s.reduce_every_microbatch and split_backward:
        raise config_error(
            f"reduce_every_microbatch=True with schedule={s.schedule!r}",
            "a zero-bubble schedule makes the weights' gradients in a pass after the backward that "
            "FSDP2 reduce-scatters them in, so they are reduced once, after the last micro-batch",
            "choose a schedule without a split backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS), "
            "or drop reduce_every_microbatch",
        )


def check_dp_shard(s: PipeSettings) -> None:
    """``dp_shard`` is a count, and only sharded data parallelism takes it (whether it divides ``dp``
    is known with the world size: :func:`.topology.resolve`)."""
    if s.dp_shard is None:
        return
    if isinstance(s.dp_shard, bool) or not isinstance(s.dp_shard, int) or s.dp_shard < 1:
        raise config_error(
            f"dp_shard={s.dp_shard!r}",
            "the replicas a stage is sharded over are an integer number >= 1",
            "set dp_shard to a divisor of dp, or leave it unset to shard over every replica",
        )
    if s.data_parallel != "fsdp":
        raise config_error(
            f"dp_shard={s.dp_shard} with data_parallel={s.data_parallel!r}",
            "hybrid sharding shards each stage over dp_shard replicas with FSDP2; DDP shards nothing",
            "set data_parallel='fsdp', or drop dp_shard",
        )


def refuse_ties(names: List[str]) -> None:
    """Weights tied across pipeline ranks inside the pipelined Sequential are summed over their
    ranks as whole tensors, which sharding them would split differently on each rank."""
    raise config_error(
        f"data_parallel='fsdp' with weights tied across pipeline stages ({', '.join(names[:3])})",
        "a tied weight's copies are summed over the ranks that hold them, whole, so they are not sharded",
        "pipeline the model with pipeline_of (a tie outside its layers stays replicated), "
        "or use data_parallel='ddp'",
    )


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP's policy for Lightning's ``precision``: ``bf16-mixed`` computes in bf16 and reduces and
    keeps the sharded (master) parameters in fp32; any other precision leaves dtypes as they are."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


@dataclass
class Sharding:
    """How this rank's stages are sharded: by ``fully_shard`` over ``mesh`` (the ``dp`` dimension,
    or it split into ``("dp_replicate", "dp_shard")`` under hybrid sharding), replica 0 of
    ``replicas`` (the ``dp`` dimension) giving every replica its values first; split over ``tp``
    before, under tensor parallelism."""

    mesh: DeviceMesh
    replicas: DeviceMesh
    reshard_after_forward: bool
    policy: MixedPrecisionPolicy
    tp: Optional[TensorParallel] = None
    outside: Sequence[nn.Module] = ()  # a module pipeline's modules outside its layers, sharded

    @classmethod
    def of(cls, s: PipeSettings, mesh: Optional[DeviceMesh], *, precision: str) -> Optional["Sharding"]:
        """The sharding ``s`` asks for (``data_parallel='fsdp'``) over ``mesh``'s ``dp`` dimension
        (``dp_shard < dp``: over that dimension split into ``dp_replicate`` x ``dp_shard``), or None."""
        if s.data_parallel != "fsdp":
            return None
        assert mesh is not None, "the mesh is made when the processes connect"
        dp, k = mesh["dp"], s.dp_shard
        sharded_over = dp
        if k is not None and k < dp.size():  # HSDP: the replicas as (dp / dp_shard) x dp_shard
            sizes, names = (dp.size() // k, k), ("dp_replicate", "dp_shard")
            # made once per mesh (kept_groups: why), keyed by the mesh's id and holding the mesh,
            # so that its id cannot pass to another mesh while the split is kept
            _, sharded_over = kept(
                ("split", id(mesh), sizes, names), lambda: (mesh, split_mesh_dim(dp, sizes, names))
            )
        policy = mixed_precision(precision)
        tp = TensorParallel.of(s, mesh)
        return cls(sharded_over, dp, bool(s.reshard_after_forward), policy, tp)

    @property
    def group(self) -> dist.ProcessGroup:
        """This rank's replicas (the flat ``dp`` group)."""
        return self.replicas.get_group()

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The replicas that hold the other shards of this rank's parameters."""
        return self.mesh.get_group("dp_shard") if self.mesh.ndim == 2 else self.group

    @property
    def src(self) -> int:
        """The global rank of replica 0 in this rank's ``dp`` group."""
        return dist.get_global_rank(self.group, 0)

    def shard(self, stage_module: nn.Module, layers: Iterable[nn.Module]) -> nn.Module:
        """``stage_module`` as an ``FSDPModule`` whose ``layers`` that train parameters are each
        sharded apart (split over ``tp`` first); returns it (sharded in place)."""
        layers = list(layers)
        if self.replicas.size() > 1:
            later = pending_reads(stage_module)  # every replica reads them from the checkpoint once sharded
            with torch.no_grad():
                for t in (*stage_module.parameters(), *stage_module.buffers()):
                    if not t.is_meta and id(t) not in later:
                        dist.broadcast(t.data, src=self.src, group=self.group)
        if self.tp is not None:
            self.tp.split(layers)
        options: Dict[str, Any] = dict(
            mesh=self.mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=self.policy
        )
        sharded = []
        for layer in layers:
            if any(p.requires_grad and not p.is_meta for p in layer.parameters()):
                sharded.append(fully_shard(layer, **options))
        fully_shard(stage_module, **options)
        # The stage is its layers' root now, not at its first forward: a module pipeline's stage runs
        # up to the first layer of the next stage, which may be this rank's too (a V schedule), and
        # that layer's own forward hook would otherwise make it a root of its own.
        make_fsdp_root(stage_module)
        stage_module.register_forward_pre_hook(_gathered(sharded))
        return stage_module

    def shard_layers(
        self,
        stage_modules: Sequence[nn.Module],
        replicas: Optional[Replicas],
        outside: Sequence[nn.Module] = (),
    ) -> None:
        """A module pipeline's stages sharded, and the modules ``outside`` its layers that only this
        pipeline rank holds (an embedding, a final norm, a head), each an FSDP2 root of its own: its
        call gathers it, its backward reduce-scatters its gradient (every micro-batch's: torch's stage
        defers only its own module's). The rest stays with ``replicas``, which no longer average the
        sharded ones."""
        inside = {id(p) for m in (*stage_modules, *outside) for p in m.parameters()}
        for m in stage_modules:
            self.shard(m, list(m.stage.partition.children()))  # type: ignore[union-attr]
        options: Dict[str, Any] = dict(
            mesh=self.mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=self.policy
        )
        for m in outside:  # innermost first; replica 0's values are everyone's already (Replicas.broadcast)
            fully_shard(m, **options)
        self.outside = [m for m in outside if not any(o is not m and _within(m, o) for o in outside)]
        for m in self.outside:
            make_fsdp_root(m)
        if replicas is not None:
            replicas.params = [p for p in replicas.params if id(p) not in inside]

    @staticmethod
    def reshard(modules: Iterable[nn.Module]) -> None:
        """Frees the gathered parameters a forward-only step left (they are kept across a
        training step's micro-batches when ``reshard_after_forward`` is off)."""
        for module in modules:
            if isinstance(module, FSDPModule):
                module.reshard()

    def squared_norm(self, grads: List[Tensor], device: torch.device) -> Tensor:
        """The squared 2-norm of ``grads`` over this pipeline rank's replicas (and tensor-parallel
        ranks): each DTensor gradient's shards summed over the mesh dimensions it is split on, so each
        element counts once; the plain gradients and the replicated dimensions (``dp_replicate``:
        every group holds the same shards), once."""
        split: Dict[Tuple[str, ...], List[Tensor]] = {(): [g for g in grads if not isinstance(g, DTensor)]}
        for g in grads:
            if isinstance(g, DTensor):
                names = g.device_mesh.mesh_dim_names or ()
                over = tuple(_SPLIT.get(n, n) for n, p in zip(names, g.placements) if not p.is_replicate())
                split.setdefault(over, []).append(g.to_local())
        assert set(split) <= {(), ("dp",), ("tp",), ("dp", "tp")}, f"split over {list(split)}"
        [plain, dp, tp, both] = [
            _squared(split.get(k, []), device) for k in [(), ("dp",), ("tp",), ("dp", "tp")]
        ]
        over_tp = torch.stack([tp, both])  # summed over tp, then (both) over dp: the same order everywhere
        if self.tp is not None:
            dist.all_reduce(over_tp, group=self.tp.mesh.get_group())
        over_dp = torch.stack([dp, over_tp[1]])
        dist.all_reduce(over_dp, group=self.shard_group)
        return plain + over_tp[0] + over_dp.sum()


def _within(module: nn.Module, other: nn.Module) -> bool:
    return any(m is module for m in other.modules())


#: The dimension a gradient's shards are summed over, by the mesh dimension it is split on.
_SPLIT = {"dp_shard": "dp"}


def _gathered(layers: List[FSDPModule]) -> Callable[..., None]:
    """A stage's forward pre-hook: its layers' parameters gathered before the stage runs, not at each
    layer's own forward, so that the stage's checkpointing (which hands the parameters it finds on
    its layers to its backward, :mod:`pipeckpt.stages.recompute`) finds the gathered ones: the same
    tensors every step, which the layers' computation uses and FSDP reduces the gradients of."""

    def gather(module: nn.Module, args: Any) -> None:
        for layer in layers:
            layer.unshard()

    return gather


def _squared(grads: List[Tensor], device: torch.device) -> Tensor:
    if not grads:
        return torch.zeros((), device=device)
    return torch.nn.utils.get_total_norm(grads).float().to(device) ** 2


def sharded_like(held: Dict[str, Any], state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` (full tensors, as any checkpoint holds them) with the value of each key that
    ``held`` holds as a DTensor replaced by this rank's shard of it, laid out as ``held``'s."""
    return {k: _like(held.get(k), v) for k, v in state.items()}


def _like(held: Any, value: Any) -> Any:
    if not isinstance(held, DTensor) or not isinstance(value, Tensor) or isinstance(value, DTensor):
        return value
    return distribute_tensor(
        value.to(held.device, held.dtype), held.device_mesh, held.placements, src_data_rank=None
    )


def shard_optimizer_state(optimizer: Optimizer, state: Dict[str, Any]) -> Dict[str, Any]:
    """Optimizer ``state`` at torch's indices, each full tensor of a DTensor parameter's entry
    (``exp_avg``, ...) replaced by this rank's shard; scalars (``step``) stay as they are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out: Dict[Any, Any] = {}
    for index, entry in state["state"].items():
        param: Optional[Tensor] = params[index] if isinstance(index, int) and index < len(params) else None
        if isinstance(param, DTensor):
            entry = {k: _like(param, v) if _full_of(param, v) else v for k, v in entry.items()}
        out[index] = entry
    return dict(state, state=out)


def _full_of(param: DTensor, value: Any) -> bool:
    return isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == param.shape
