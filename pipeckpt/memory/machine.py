"""Whether a model's real build fits this machine's memory, asked before building it.

Why: ``python -m pipeckpt.plan`` profiles the model it plans, and a model larger than the machine
(the 405B one a user plans a cluster for) killed the command by running out of memory before it
printed anything. The model built on the meta device gives the bytes of its parameters and buffers
from their shapes, allocating nothing; a real profile holds those, a gradient for each, and one
micro-batch's activations, for which :data:`MARGIN` is left. Where that is more than the memory
available, the command plans on fake tensors instead (docs/MEMORY.md).
"""

import os
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.memory.fake_weights import state_bytes
from pipeckpt.sizes import human

__all__ = ["MARGIN", "available_memory", "meta_state_bytes", "real_build_bytes", "fake_or_real"]

#: Left above the weights and their gradients for one micro-batch's activations and the interpreter.
MARGIN = 2**30


def available_memory() -> int:
    """Bytes of memory available to a new allocation now: Linux's ``MemAvailable`` (free memory
    plus the page cache it can reclaim), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB (KiB)
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def meta_state_bytes(build: Callable[[], nn.Module]) -> Optional[int]:
    """The bytes of the parameters and buffers of the module ``build()`` makes, built on the meta
    device (the generators left as they were); None where the build cannot run there (it reads a
    value it made, say): the caller then knows nothing and builds as it would have."""
    with torch.random.fork_rng(), torch.device("meta"):
        try:
            module = build()
        except Exception:  # any failure on meta only means the size is unknown
            return None
    return state_bytes(module)


def real_build_bytes(state: int) -> int:
    """What a real build and profile of a model with ``state`` bytes of parameters and buffers
    needs: the weights, a gradient as large, and :data:`MARGIN`."""
    return 2 * state + MARGIN


def fake_or_real(
    fake: Optional[bool], build: Callable[[], nn.Module], *, available: Optional[int] = None
) -> Tuple[bool, Optional[str]]:
    """Whether to build the model ``build()`` makes on fake tensors, and the one line saying why
    when the user did not ask (``fake`` None): where its real build would not fit the memory
    ``available`` (default: :func:`available_memory`). ``fake=False`` builds it for real unless
    its weights alone exceed that memory: a config error then, before building, not an
    out-of-memory kill halfway through."""
    if fake:
        return True, None
    state = meta_state_bytes(build)
    if state is None:  # not buildable on meta: a real build, as before
        return False, None
    free = available if available is not None else available_memory()
    if fake is False:
        if state > free:
            raise config_error(
                f"memory.fake=false with a model of {human(state)} of parameters and buffers",
                f"a real build holds them all, and {human(free)} of memory is available",
                "drop memory.fake=false to plan it on fake tensors (nothing allocated), "
                "or plan a smaller model",
            )
        return False, None
    need = real_build_bytes(state)
    if need <= free:
        return False, None
    return True, (
        f"memory.fake: building on fake tensors (times from FLOPs): the model's {human(state)} of "
        f"parameters and buffers, their gradients and a {human(MARGIN)} margin need {human(need)}, "
        f"more than the {human(free)} available (memory.fake=false builds it for real)"
    )
