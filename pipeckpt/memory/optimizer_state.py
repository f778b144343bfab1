"""What an optimizer holds beside the parameters it updates: its state per parameter (kept from
step to step) and what one of its steps allocates while it runs. The walk
(:mod:`pipeckpt.memory.walk`) adds both to a stage's parameters and gradients; the sharded model
(:mod:`pipeckpt.memory.sharding`) counts the state of one rank's shards.
"""

from typing import Union

import torch

from pipeckpt._errors import config_error
from pipeckpt.sizes import OPTIMIZERS

__all__ = ["optimizer_state_bytes", "optimizer_step_bytes"]


def optimizer_state_bytes(
    optimizer: Union[str, torch.optim.Optimizer, type], param_bytes: int, tensors: int
) -> int:
    """State an optimizer keeps for ``tensors`` parameter tensors of ``param_bytes`` in all:
    SGD none, SGD with momentum one buffer, Adam(W) two moments and a 4-byte step per tensor.

    Args:
        optimizer: a name of :data:`pipeckpt.sizes.OPTIMIZERS`, an optimizer, or its class.
        param_bytes: the parameters' bytes.
        tensors: how many parameter tensors they are.
    """
    name = _optimizer_name(optimizer)
    extra = 4 * tensors if name in ("adam", "adamw") else 0
    return int(OPTIMIZERS[name] * param_bytes) + extra


def optimizer_step_bytes(optimizer: Union[str, torch.optim.Optimizer, type], largest_param: int) -> int:
    """What one step of the optimizer allocates beside parameters, gradients and state: Adam(W)'s
    update of one parameter at a time (torch's default on CPU) makes its denominator from two
    temporaries of the parameter's size, so twice its largest parameter; SGD updates in place.

    Args:
        optimizer: a name of :data:`pipeckpt.sizes.OPTIMIZERS`, an optimizer, or its class.
        largest_param: the bytes of the largest parameter it updates.
    """
    return 2 * largest_param if _optimizer_name(optimizer) in ("adam", "adamw") else 0


def _optimizer_name(optimizer: Union[str, torch.optim.Optimizer, type]) -> str:
    if isinstance(optimizer, torch.optim.Optimizer):
        if isinstance(optimizer, torch.optim.SGD):
            return "momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
        optimizer = type(optimizer)
    if isinstance(optimizer, type):
        optimizer = optimizer.__name__
    name = str(optimizer).lower()
    if name not in OPTIMIZERS:
        raise config_error(
            f"optimizer {optimizer!r}",
            f"the memory model knows the state of {list(OPTIMIZERS)}",
            "name one of those (or pass the optimizer object)",
        )
    return name
