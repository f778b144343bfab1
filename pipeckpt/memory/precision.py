"""The autocast region a training step's forward runs in, to profile under it.

Why: under ``bf16-mixed`` a layer keeps bf16 activations. A profile taken in fp32 counts them at
twice their size: on a GPT block stack in bf16 on the CPU, 1.26-1.45x each stage's measured peak, so
``checkpoint='auto'`` would recompute more than its budget asks and the plan command's table would
not be the run's. The region is Lightning's own (a precision plugin's ``forward_context``): the plugin
the Trainer steps under (``auto``, ``MemoryCheck``), or, for the plan command and the benchmarks,
the one a precision's name makes (:func:`forward_context`).
"""

from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from pipeckpt.memory.sharding import PRECISIONS

__all__ = ["forward_context"]

#: Lightning's mixed precisions, the ones whose step runs under autocast: those that compute in
#: another dtype than they keep the parameters in (the one table of precision names, memory/sharding.py).
_MIXED = tuple(name for name, (compute, kept) in PRECISIONS.items() if compute != kept)


def forward_context(precision: Any, device: torch.device) -> ContextManager[Any]:
    """What a step's forward runs under ``precision``, named as ``Trainer(precision=...)`` takes it
    (a Trainer's own is ``trainer.precision_plugin.forward_context()``). A mixed one is the region
    Lightning's ``MixedPrecision`` plugin opens on ``device``: autocast without its weight-cast cache,
    so each micro-batch casts, and keeps, its own copies. Nothing for the rest (``bf16-true`` computes
    in the parameters' own dtype)."""
    name = str(precision)
    if name not in _MIXED:
        return nullcontext()
    return MixedPrecision(name, device.type).forward_context()  # type: ignore[arg-type]
