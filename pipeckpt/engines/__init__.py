"""Engines run a :class:`~pipeckpt.planning.StagePlan`'s stages: ``local`` in one
process (torchgpipe), ``distributed`` with one process per stage."""

from typing import List

__all__: List[str] = []

ENGINES = ("local", "distributed")
