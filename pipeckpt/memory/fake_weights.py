"""A module built on the meta device profiled on fake tensors, for ``checkpoint="auto"``.

Why: a module built on meta (``configure_model``, ``init_module(empty_init=True)``) is the one
too large for any process to hold whole, which is where a plan matters most; yet the profile runs
the layers. Meta tensors carry no storage for the profile to name and run no kernels, and making
the module real would allocate what the meta build avoided. Fake tensors (torch's
``FakeTensorMode``, which ``python -m pipeckpt.plan`` profiles 405B models on) have storages of
the real sizes and allocate nothing, so each of the module's meta tensors is swapped for a fake
one of its shape, dtype and device while the profile runs, and swapped back after: the meta build
stays as it was for the engine to make each process's stages real.
"""

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import own_tensors, set_own_tensor
from pipeckpt._errors import config_error
from pipeckpt.memory.profile import fake_mode

__all__ = ["fake_weights", "state_bytes"]


def state_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (each tensor once, tied ones too), read from
    their shapes and dtypes: on the meta device it allocates nothing."""
    seen = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


@contextmanager
def fake_weights(
    module: nn.Module, device: torch.device, *, what: str = "checkpoint='auto'", fix: Optional[str] = None
) -> Iterator[Any]:
    """Within: ``module``'s meta parameters and buffers replaced by fake tensors on ``device``
    (tied ones stay tied, ``requires_grad`` kept), under the fake mode this yields, which the
    profile runs in; after: the meta tensors back in their places. An op fake tensors cannot run
    (one that reads a value: ``.item()``, a data-dependent shape) is a config error naming the
    module: the plan needs values the meta build does not have. ``what`` names the planner in it,
    ``fix`` replaces its remedy (``checkpoint='auto'``'s by default)."""
    swapped: List[Tuple[nn.Module, str, Tensor, bool]] = []
    made: Dict[int, Tensor] = {}
    with fake_mode() as mode:
        try:
            for owner in module.modules():
                for name, t, is_param in own_tensors(owner):  # every slot, a tensor held twice too
                    if not t.is_meta:
                        continue
                    if id(t) not in made:
                        empty = torch.empty_like(t, device=device)
                        made[id(t)] = nn.Parameter(empty, t.requires_grad) if is_param else empty
                    swapped.append((owner, name, t, is_param))
                    set_own_tensor(owner, name, made[id(t)], is_param)
            yield mode
        except (RuntimeError, NotImplementedError) as error:  # torch's fake tensors refused an op
            raise config_error(
                f"{what} with {type(module).__name__} built on the meta device",
                "a module built on meta is profiled on fake tensors, which hold no values, and its "
                f"step failed there ({type(error).__name__}: {str(error).splitlines()[0]})",
                fix
                or "choose the checkpoint modes yourself (`python -m pipeckpt.plan` predicts their "
                "peaks), or build the module eagerly (not in configure_model, nor under "
                "init_module(empty_init=True))",
            ) from error
        finally:
            for owner, name, t, is_param in reversed(swapped):
                set_own_tensor(owner, name, t, is_param)
