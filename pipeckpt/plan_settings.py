"""The strategy's settings as ``train.py`` builds them, for the plan command's two paths: one
device per stage (:mod:`pipeckpt.plan`) and a layout given by hand on a named cluster
(:mod:`pipeckpt.plan_hand`).

Why one function: ``train.py`` refuses a misspelt strategy key, a chunk count of 0 or an engine's
foreign setting when it builds the strategy. The plan command answers the same configs before any
training, so both its paths run these same checks, in the user's names, before any work is done.
"""

from typing import Any, Dict, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from pipeckpt._errors import config_error
from pipeckpt.engines import engine_class
from pipeckpt.memory.auto import parse_bytes
from pipeckpt.settings import PipeSettings, check_names

__all__ = ["strategy_settings"]


def strategy_settings(cfg: DictConfig, *, fit_to: Optional[int] = None) -> Tuple[PipeSettings, Optional[int]]:
    """The strategy's settings, checked as the strategy checks them, and the budget to mark the
    stages against (``memory.budget``; None when not given).

    ``fit_to``: the bytes a device holds, where ``ckpt=auto`` without a budget is fitted to the
    device (a layout checked on a cluster) rather than refused (train.py needs the budget)."""
    container = OmegaConf.to_container(cfg.strategy, resolve=True)
    assert isinstance(container, dict)
    given: Dict[str, Any] = {str(k): v for k, v in container.items()}
    if given.pop("_target_", None) is None:
        raise config_error(
            f"strategy={given.get('name')!r}",
            "the plan command models the pipe strategy",
            "use strategy=pipe",
        )
    budget = given.get("memory_budget")
    if given.get("checkpoint") != "auto":  # a budget here only marks the stages against it
        given.update(memory_budget=None, memory_search=None)
    elif budget is None and fit_to is not None:
        given.update(memory_budget=fit_to)
    check_names(given, "strategy")
    settings = PipeSettings(**given)
    engine_class(settings.engine).check_settings(settings)
    return settings, parse_bytes(budget, "memory.budget") if budget is not None else None
