"""Which ranks hold each of a ``pipeline_of`` model's parameters outside its layers, as the memory
model counts them.

The distributed engine gives each parameter outside the layers to the stages that read it (the
embedding to the first, the final norm and head to the last, a tied weight to both:
engines/distributed/outside_parts.py), from a probe of the model's own ``forward``
(:func:`~pipeckpt.boundaries.outside_uses.outside_uses`). The memory model reads the same probe, run
where the profile runs (on the profile's fake tensors for a model too large to hold), so that each
stage counts exactly what its rank holds: parameters, gradients and optimizer state. The local
engine's one process holds them all; its walk counts them on the last stage, as before.
"""

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pipeckpt.boundaries.outside_uses import OutsideUses, outside_uses
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.memory.rooted import RootInput

__all__ = ["OutsideParam", "outside_params", "stage_share"]


@dataclass(frozen=True)
class OutsideParam:
    """One parameter outside the layers: its bytes, whether it trains, and who reads it.

    Args:
        name: its name in the model passed to ``pipeline_of``.
        bytes: its size.
        trained: ``requires_grad`` (a gradient and optimizer state), else only held.
        layers: the layers (by index) whose calls read it.
        output: the model's output reads it (the last stage).
        everywhere: read outside its module's call: every stage holds it.
    """

    name: str
    bytes: int
    trained: bool
    layers: FrozenSet[int]
    output: bool
    everywhere: bool

    def held_by(self, start: int, stop: int, last: bool) -> bool:
        """Whether the stage of layers ``[start, stop)`` (the last one when ``last``) holds it."""
        return self.everywhere or (last and self.output) or any(i in self.layers for i in range(start, stop))


def outside_params(spec: ModulePipeline, call: RootInput) -> Tuple[OutsideParam, ...]:
    """The parameters outside ``spec``'s layers with their readers, probed on ``call`` on the tensors
    the model holds now (real, or the profile's fake ones). Where the probe fails, every stage holds
    them all, as the engine does then."""
    try:
        uses: Optional[OutsideUses] = outside_uses(
            spec, call.args, call.kwargs, _device(spec.root), fake=False
        )
    except Exception:  # the engine holds everything everywhere where its probe fails
        uses = None
    inside = {id(p) for p in spec.parameters()}
    out = []
    for name, p in spec.root.named_parameters():
        if id(p) in inside:
            continue
        size = p.numel() * p.element_size()
        if uses is None:
            out.append(OutsideParam(name, size, p.requires_grad, frozenset(), False, True))
            continue
        readers = frozenset(i for i, used in enumerate(uses.layers) if name in used)
        out.append(
            OutsideParam(name, size, p.requires_grad, readers, name in uses.output, name in uses.everywhere)
        )
    return tuple(out)


def stage_share(params: Sequence[OutsideParam], start: int, stop: int, last: bool) -> List[OutsideParam]:
    """The parameters of ``params`` that the stage of layers ``[start, stop)`` holds."""
    return [p for p in params if p.held_by(start, stop, last)]


def _device(module: nn.Module) -> torch.device:
    """Where the probe makes what the model's meta tensors stand for (the model's own device)."""
    for t in module.parameters():
        if not t.is_meta:
            return t.device
    return torch.device("cpu")
