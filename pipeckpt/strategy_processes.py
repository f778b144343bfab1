"""The half of :class:`~pipeckpt.strategy.PipelineStrategy` that answers Lightning's questions about
processes: devices, ranks, samplers and collectives, each delegated to the engine.

Why a class of its own: these answers are the same for every engine (the engine decides, this only
asks it), so the strategy's own class keeps to what a pipeline changes in Lightning's loop.
"""

from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from pipeckpt._compat import sampler_follows_loader, sync_ddp_if_available
from pipeckpt.engines.base import Engine, World

__all__ = ["ProcessStrategy"]


class ProcessStrategy(ParallelStrategy):
    """Devices, ranks, samplers and collectives, answered by ``self.engine`` (set by the subclass)."""

    engine: Engine
    num_nodes: int

    @property
    @override
    def root_device(self) -> torch.device:
        return self.engine.root_device(self.parallel_devices or [torch.device("cpu")], self.local_rank)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self.engine.restore_after_setup

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return self.engine.is_distributed

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """This replica's share: every process of one pipeline reads the same batches. Under
        ``layout="auto"`` every process reads every batch, each replica training its share of it
        (:func:`pipeckpt.strategy_layout.replica_share`)."""
        search = getattr(self, "layout_search", None)
        if search is not None and search.pick is not None:
            return {"num_replicas": 1, "rank": 0}
        return self.engine.sampler_kwargs(self.global_rank)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        if self.engine.is_distributed and module is not None:
            # The distributed sampler shuffles a training loader only if the loader shuffles, as the
            # local engine (no such sampler) reads it.
            sampler_follows_loader(module.trainer)

    def _world(self) -> World:
        return World(num_nodes=self.num_nodes, num_processes=self.num_processes, global_rank=self.global_rank)

    def set_world_ranks(self) -> None:
        if self.engine.is_distributed and self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
            rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        if self.num_processes:  # bad topologies fail when the Trainer is built
            self.engine.configure_world(self._world())

    # -- collectives: identities in one process --

    def _collective(self) -> bool:
        return self.engine.is_distributed and dist.is_available() and dist.is_initialized()

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor) and self._collective():
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if self._collective():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._collective():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        if not self._collective():
            return tensor
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)
