"""The distributed engine's half of the Engine protocol that reads and writes checkpoints.

Why a class of its own: the engine's checkpoint methods only route to :class:`.state.StateIO`, adding
what FSDP2 changes (each replica writes its own shards; a full tensor from any layout is cut into this
rank's shard on load), and the engine class keeps to building and stepping.
"""

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule
from torch.optim import Optimizer

from pipeckpt.engines.distributed.sharding import Sharding, shard_optimizer_state, sharded_like
from pipeckpt.engines.distributed.state import StateIO
from pipeckpt.engines.distributed.ties import Replicas

__all__ = ["EngineCheckpoints"]


class EngineCheckpoints:
    """The checkpoint methods of :class:`~pipeckpt.engines.distributed.engine.DistributedEngine`."""

    state: StateIO
    sharding: Optional[Sharding]
    replicas: Optional[Replicas]
    module: Optional[LightningModule]

    if TYPE_CHECKING:  # the Engine base class's, after this class in the engine's bases

        def _by_index(self, optimizer: Optimizer, state: Dict[str, Any]) -> Dict[str, Any]: ...

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
        # Shards differ between replicas: each writes its own (DCP writes a replicated tensor once).
        another = self.replicas is not None and self.sharding is None
        self.state.save(checkpoint, path, written_by_another=another)

    def load_checkpoint(self, path: Any, io: CheckpointIO, weights_only: Optional[bool]) -> Dict[str, Any]:
        return self.state.load(path, self.module, io, weights_only)

    def load_module_state_dict(self, module: LightningModule, state: Dict[str, Any], strict: bool) -> None:
        if self.sharding is not None:  # full tensors, from a checkpoint of any layout
            state = sharded_like(module.state_dict(), state)
        self.state.load_module_state(module, state, strict)

    def load_optimizer_state(self, optimizer: Optimizer, state: Dict[str, Any]) -> None:
        state = self._by_index(optimizer, state)
        if self.sharding is not None:
            state = shard_optimizer_state(optimizer, state)
        self.state.load_optimizer_state(optimizer, state)
