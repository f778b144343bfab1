"""Engines run a :class:`~pipeckpt.stages.partition.StagePlan`'s stages behind one protocol
(:class:`~pipeckpt.engines.base.Engine`): ``local`` in one process (torchgpipe),
``distributed`` with one process per stage (``torch.distributed.pipelining``).

The table names each engine's class by import path, so that choosing an engine
imports only that engine (the distributed one pulls in torch.distributed).
"""

import importlib
from typing import Dict, List, Type, Union

from pipeckpt._errors import config_error
from pipeckpt.engines.base import Engine

__all__: List[str] = []

ENGINES: Dict[str, Union[str, Type[Engine]]] = {
    "local": "pipeckpt.engines.local:LocalEngine",
    "distributed": "pipeckpt.engines.distributed:DistributedEngine",
}


def register(name: str, engine: Union[str, Type[Engine]]) -> None:
    """Adds ``engine`` (a class, or ``"module:Class"`` to import when chosen) as ``engine=name``.

    Args:
        name: the value of the ``engine`` setting that chooses it.
        engine: an :class:`~pipeckpt.engines.base.Engine` subclass or its import path.
    """
    ENGINES[name] = engine


def engine_class(name: str) -> Type[Engine]:
    """The engine registered as ``name``."""
    if not isinstance(name, str) or name not in ENGINES:
        raise config_error(
            f"engine={name!r}",
            f"must be one of {tuple(ENGINES)}",
            "use 'local' (one process) or 'distributed' (one process per stage)",
        )
    row = ENGINES[name]
    if not isinstance(row, str):
        return row
    module, _, cls = row.partition(":")
    engine: Type[Engine] = getattr(importlib.import_module(module), cls)
    return engine
