"""State I/O of the distributed engine: sharded checkpoints under the module's own keys.

Why not Lightning's ``torch.save`` on rank 0: no process holds the whole model (the other stages are
on the meta device). Every rank writes its own stages into one ``torch.distributed.checkpoint``
directory (:mod:`pipeckpt.state.sharded`) under the unpipelined module's keys, and a resume reads only
the keys of the stages it holds now, once they are built; so a checkpoint moves between engines,
stage counts and world sizes (``python -m pipeckpt.convert`` makes it one file).
"""

import os
from typing import Any, Dict, List, Optional

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.optim import Optimizer

from pipeckpt import _rng
from pipeckpt._errors import config_error
from pipeckpt.engines.base import optimizer_param_names
from pipeckpt.engines.distributed.processes import ProcessGroups
from pipeckpt.state import safe_load, sharded
from pipeckpt.state.fit import check_fits
from pipeckpt.state.sharded_index import read_index

__all__: List[str] = []


def _without_tensors(checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    """``checkpoint`` with no model or optimizer tensors: what a replica whose copies another writes
    hands to the (collective) sharded writer."""
    out = dict(checkpoint, state_dict={})
    if "optimizer_states" in out:
        out["optimizer_states"] = [dict(o, state={}) for o in out["optimizer_states"]]
    return out


def _held(value: Any) -> bool:
    return not (isinstance(value, Tensor) and value.is_meta)


class StateIO:
    """This process's share of the model, optimizer and RNG state."""

    def __init__(self, processes: ProcessGroups) -> None:
        self.processes = processes

    @staticmethod
    def module_state_dict(module: LightningModule) -> Dict[str, Any]:
        """This process's entries of the module's state dict (other ranks' are on meta)."""
        return {k: v for k, v in module.state_dict().items() if _held(v)}

    @staticmethod
    def optimizer_state(module: LightningModule, optimizer: Optimizer) -> Dict[str, Any]:
        """This process's optimizer state, keyed by parameter name (the positions of a
        pipelined optimizer are the unpipelined one's, but names survive any layout)."""
        return sharded.optimizer_state_by_name(
            optimizer.state_dict(), optimizer_param_names(module, optimizer)
        )

    def rng_states(self) -> List[Dict[str, Any]]:
        """Every rank's RNG states on global rank 0 (every rank draws its own dropout masks)."""
        mine = _rng.collect()
        if not self.processes.connected:
            return [mine]
        return self.processes.gathered_on_zero(mine) or [mine]

    def my_rng_state(self, by_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
        """This rank's entry on the same world; global rank 0's when the world changed."""
        same_world = len(by_rank) == self.processes.world.size
        return by_rank[self.processes.rank] if same_world else by_rank[0]

    def save(self, checkpoint: Dict[str, Any], path: Any, *, written_by_another: bool) -> None:
        """Every rank writes its own stages; ``written_by_another``: replicas hold copies that
        replica 0 writes, once (the others still join the collective writer)."""
        if written_by_another and self.processes.replica > 0:
            checkpoint = _without_tensors(checkpoint)
        sharded.save(checkpoint, path)

    @staticmethod
    def load(
        path: Any, module: Optional[LightningModule], io: CheckpointIO, weights_only: Optional[bool]
    ) -> Dict[str, Any]:
        """A sharded checkpoint (this process's keys), or a single file (the local engine's)."""
        if sharded.is_sharded(path) or os.path.isdir(path):  # an incomplete one is named by sharded.load
            assert module is not None, "restored after build (restore_after_setup)"
            return StateIO.load_sharded(path, module, weights_only)
        return safe_load.load_with(io, path, weights_only)  # a single file, the local engine's

    @staticmethod
    def load_sharded(path: Any, module: LightningModule, weights_only: Any) -> Dict[str, Any]:
        """A sharded checkpoint as far as this process needs it: its stages' keys only. Its index is
        checked against the module first, by the local engine's check (a checkpoint of another model
        named by its differing keys and hyper-parameters); without ``strict_loading``, the keys the
        checkpoint lacks are left as they are, as Lightning's non-strict load does."""
        mine = StateIO.module_state_dict(module)
        keys = list(mine)
        index = None
        if sharded.is_sharded(path):  # an incomplete one is named by sharded.load
            index = read_index(path, weights_only=weights_only)
            stored, hparams = index.model()
            strict = bool(getattr(module, "strict_loading", True))
            found = {"state_dict": stored, "hyper_parameters": hparams}
            check_fits(module, mine, found, strict=strict, source=str(path))
            keys = keys if strict else [key for key in keys if key in stored]
        return sharded.load(path, keys=keys, weights_only=weights_only, index=index)

    @staticmethod
    def load_module_state(module: LightningModule, state: Dict[str, Any], strict: bool) -> None:
        """Loads this process's keys; with ``strict``, every one of them must be there."""
        mine = StateIO.module_state_dict(module)
        missing = [k for k in mine if k not in state]
        if strict and missing:
            raise config_error(
                f"a checkpoint without {missing[:3]}{' ...' if len(missing) > 3 else ''}",
                "a strict load needs every key of the module, and these are this process's stages' keys",
                "resume from a checkpoint of the same model, or load with strict=False",
            )
        module.load_state_dict({k: v for k, v in state.items() if k in mine}, strict=False)

    @staticmethod
    def load_optimizer_state(optimizer: Optimizer, full: Dict[str, Any]) -> None:
        """Loads the entries of this process's parameters from optimizer state at torch's indices."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mine = {i: s for i, s in full["state"].items() if i < len(params) and not params[i].is_meta}
        optimizer.load_state_dict({"state": mine, "param_groups": full["param_groups"]})
