"""The ``local`` engine: every stage in this process, on one host's devices (see :mod:`.engine`)."""

from pipeckpt.engines.local.engine import LocalEngine

__all__ = ["LocalEngine"]
