"""State I/O of the distributed engine: model, optimizer and RNG state under the module's own keys.

Each process holds only its stages' tensors (the rest of the module is on the
meta device). Keys and optimizer indices are the unpipelined module's, so a
checkpoint moves freely between engines and stage counts: a process takes what
belongs to its stages from whatever was saved.
"""

from collections import OrderedDict
from typing import Any, Dict, List

from torch import Tensor
from torch.optim import Optimizer

from pipeckpt import _rng
from pipeckpt.engines.distributed.processes import ProcessGroups
from pipeckpt.engines.distributed.step import to_cpu

__all__: List[str] = []


class StateIO:
    """Gathers and scatters the state of a pipeline whose stages live in several processes."""

    def __init__(self, processes: ProcessGroups) -> None:
        self.processes = processes

    def _owner(self) -> bool:
        """Whether this process's tensors are the ones written (replica 0 of each stage)."""
        return self.processes.replica == 0

    def module_state_dict(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The whole model's state dict on global rank 0 (a collective)."""
        if not self.processes.connected:
            return state
        mine = None
        if self._owner():
            mine = {k: to_cpu(v) for k, v in state.items() if not (isinstance(v, Tensor) and v.is_meta)}
        pieces = self.processes.gathered_on_zero(mine)
        if pieces is None:
            return state
        merged: Dict[str, Any] = OrderedDict()
        for key in state:
            merged[key] = next(p[key] for p in pieces if p is not None and key in p)
        return merged

    def optimizer_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The state of every parameter on global rank 0, at the whole model's optimizer indices."""
        if not self.processes.connected:
            return state
        pieces = self.processes.gathered_on_zero(to_cpu(state["state"]) if self._owner() else None)
        if pieces is None:
            return state
        merged: Dict[int, Any] = {}
        for piece in pieces:
            merged.update(piece or {})
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}

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

    @staticmethod
    def load_optimizer_state(optimizer: Optimizer, full: Dict[str, Any]) -> None:
        """Loads the entries of this process's parameters from a whole model's optimizer state."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mine = {i: s for i, s in full["state"].items() if i < len(params) and not params[i].is_meta}
        optimizer.load_state_dict({"state": mine, "param_groups": full["param_groups"]})
