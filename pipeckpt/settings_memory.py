"""The checks of ``checkpoint='auto'`` and the ``memory_*`` settings that drive it.

Why apart from :mod:`pipeckpt.settings`: they are one group of meaning (what the memory planner is
given: a budget, what it may choose, whose optimizer state it counts) and the settings module is at
the house's size limit. :class:`~pipeckpt.settings.PipeSettings` calls :func:`check_memory_settings`
in its ``__post_init__``, so a bad value still fails when the settings are made.
"""

from typing import Any, List, Optional

from pipeckpt._errors import config_error
from pipeckpt.sizes import OPTIMIZERS, parse_bytes

__all__ = ["MEMORY_SEARCH", "check_memory_settings"]

#: What ``checkpoint='auto'`` may choose besides the modes.
MEMORY_SEARCH = ("modes", "chunks", "balance")


def check_memory_settings(
    checkpoint: Any, memory_budget: Any, memory_search: Any, memory_optimizer: Optional[str]
) -> Optional[List[Any]]:
    """Refuses a budget without ``checkpoint='auto'`` (and the reverse), a budget that is no size, a
    search of anything but :data:`MEMORY_SEARCH` with the modes, an optimizer the memory model does
    not count; returns ``memory_search`` as a list (None: unset)."""
    if checkpoint == "auto" and memory_budget is None:
        raise config_error(
            "checkpoint='auto' without memory_budget",
            "auto chooses each stage's mode to fit a memory budget, so it needs one",
            "set memory_budget (bytes per device, e.g. '20GiB'; memory.budget=20GiB in the configs)",
        )
    if checkpoint != "auto" and memory_budget is not None:
        raise config_error(
            f"memory_budget={memory_budget!r} with checkpoint={checkpoint!r}",
            "the budget is what checkpoint='auto' plans to; with modes given, nothing uses it",
            "set checkpoint='auto' (ckpt=auto in the configs), or drop memory_budget",
        )
    if memory_budget is not None:
        parse_bytes(memory_budget, "memory_budget")
    search = memory_search
    if search is not None:
        if isinstance(search, str) or not isinstance(search, (list, tuple)) or not search:
            search = [search]
        bad = [v for v in search if v not in MEMORY_SEARCH]
        if bad or "modes" not in search:
            raise config_error(
                f"memory_search={memory_search!r}",
                f"is a list of {list(MEMORY_SEARCH)} that includes modes",
                "e.g. memory_search=['modes', 'chunks'] (memory.search=[modes,chunks] in the configs)",
            )
        search = list(search)
    if memory_optimizer is not None and memory_optimizer not in OPTIMIZERS:
        raise config_error(
            f"memory_optimizer={memory_optimizer!r}",
            f"the memory model counts the state of {list(OPTIMIZERS)}",
            "name the optimizer your configure_optimizers returns (adamw for the bundled models)",
        )
    return search
