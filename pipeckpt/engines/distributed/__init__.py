"""The ``distributed`` engine: one process per pipeline rank (see :mod:`.engine`)."""

from pipeckpt.engines.distributed.engine import DistributedEngine

__all__ = ["DistributedEngine"]
