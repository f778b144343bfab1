"""An optimizer's ``state_dict`` keyed by parameter name rather than by position, and back.

Why: torch keys an optimizer's state by each parameter's position in its ``param_groups``, which
differs between the layouts a checkpoint is written and resumed under (another stage count, another
engine); the parameter's name does not. A sharded checkpoint stores the state by name
(:mod:`pipeckpt.state.sharded`), and each engine turns it back into its own optimizer's positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeckpt._errors import config_error

__all__ = ["optimizer_state_by_index", "optimizer_state_by_name"]


def _param_count(state: Mapping[str, Any]) -> int:
    return sum(len(group["params"]) for group in state["param_groups"])


def optimizer_state_by_name(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name instead of position.

    ``names[i]`` is the name of the optimizer's i-th parameter (flattened over ``param_groups``).
    Both ``state`` and each group's ``params`` change from positions to names; parameters
    without state have no entry, as in torch.
    """
    if _param_count(state) != len(names):
        raise config_error(
            f"{len(names)} parameter names for an optimizer of {_param_count(state)} parameters",
            "optimizer_state_by_name needs one name per parameter, in the order of its param_groups",
            "pass the names of the optimizer's parameters (e.g. from module.named_parameters())",
        )
    return {
        "state": {names[index]: entry for index, entry in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def optimizer_state_by_index(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_name`: keys become positions in ``names``,
    the order of the parameters of the optimizer that will load the state."""
    position = {name: index for index, name in enumerate(names)}
    grouped = [name for group in state["param_groups"] for name in group["params"]]
    unknown = [name for name in [*state["state"], *grouped] if name not in position]
    if unknown:
        raise config_error(
            f"optimizer state for parameters {sorted(set(unknown))[:5]}",
            "names a parameter that the optimizer being restored does not hold",
            "resume into the module the checkpoint was written from (same parameter names)",
        )
    return {
        "state": {position[name]: entry for name, entry in state["state"].items()},
        "param_groups": [
            {**group, "params": [position[name] for name in group["params"]]}
            for group in state["param_groups"]
        ],
    }
