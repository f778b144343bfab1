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
from fnmatch import fnmatch
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pipeckpt.boundaries.outside_uses import Handoffs, OutsideUses, holds, outside_uses
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.memory.rooted import RootInput
from pipeckpt.memory.split_dims import split_dims

__all__ = ["OutsideParam", "outside_params", "sharded_share", "stage_share", "units"]


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
        shared: held by several modules (a tied weight): never FSDP-sharded.
    """

    name: str
    bytes: int
    trained: bool
    layers: FrozenSet[int]
    output: bool
    everywhere: bool
    shared: bool = False

    def held_by(self, start: int, stop: int, last: bool) -> bool:
        """Whether the stage of layers ``[start, stop)`` (the last one when ``last``) holds it."""
        return holds(self.layers, self.output, self.everywhere, start, stop, last)


def outside_params(
    spec: ModulePipeline, call: RootInput
) -> Tuple[Tuple[OutsideParam, ...], Optional[Handoffs]]:
    """The parameters outside ``spec``'s layers with their readers, and the layer outputs each stage
    receives (:class:`~pipeckpt.boundaries.outside_uses.Handoffs`), probed on ``call`` on the tensors
    the model holds now (real, or the profile's fake ones). Where the probe fails, every stage holds
    them all and receives every earlier output (None), as the engine does then."""
    try:
        uses: Optional[OutsideUses] = outside_uses(
            spec, call.args, call.kwargs, _device(spec.root), fake=False
        )
    except Exception:  # the engine holds everything everywhere where its probe fails
        uses = None
    inside = {id(p) for p in spec.parameters()}
    holders: Dict[int, int] = {}
    for m in spec.root.modules():
        for t in m.parameters(recurse=False):
            holders[id(t)] = holders.get(id(t), 0) + 1
    out = []
    for name, p in spec.root.named_parameters():
        if id(p) in inside:
            continue
        size = p.numel() * p.element_size()
        shared = holders[id(p)] > 1
        if uses is None:
            out.append(OutsideParam(name, size, p.requires_grad, frozenset(), False, True, shared))
            continue
        readers = frozenset(i for i, used in enumerate(uses.layers) if name in used)
        read = (name in uses.output, name in uses.everywhere, shared)
        out.append(OutsideParam(name, size, p.requires_grad, readers, *read))
    return tuple(out), uses.handoffs if uses is not None else None


def stage_share(params: Sequence[OutsideParam], start: int, stop: int, last: bool) -> List[OutsideParam]:
    """The parameters of ``params`` that the stage of layers ``[start, stop)`` holds."""
    return [p for p in params if p.held_by(start, stop, last)]


def sharded_share(
    params: Sequence[OutsideParam], ranges: Sequence[Tuple[int, int]]
) -> List[Tuple[List[str], List[str]]]:
    """Per stage of ``ranges``: the names of the outside parameters it holds that FSDP shards over
    its replicas (held by that stage alone and by one module, as engines/distributed/outside_parts.py
    shards them, and splits over ``tp`` where the plan names its module: :func:`units`), and of
    those it holds whole."""
    last = len(ranges) - 1
    holds = [[p for p in params if p.held_by(a, b, j == last)] for j, (a, b) in enumerate(ranges)]
    count = {p.name: sum(p in held for held in holds) for p in params}
    out = []
    for held in holds:
        alone = [p.name for p in held if count[p.name] == 1 and not p.shared]
        out.append((alone, [p.name for p in held if p.name not in alone]))
    return out


def units(
    root: nn.Module, names: Sequence[str], plan: Sequence[Tuple[str, str]] = (), tp: int = 1
) -> List[nn.Module]:
    """The parameters ``names`` of ``root``, one FSDP unit each, as ``rank_state`` counts units: each
    one tensor-parallel rank's share where ``plan`` (entries of ``tensor_parallel_plan``: a module's
    path in ``root``, a style) splits its module over ``tp`` ranks, as the engine splits an embedding
    or a head over the vocabulary (engines/distributed/vocab_plan.py)."""
    out: List[nn.Module] = []
    for name in names:
        p = root.get_parameter(name)
        path, _, own = name.rpartition(".")
        style = next((st for pattern, st in plan if path and fnmatch(path, pattern)), None)
        dim = split_dims(root.get_submodule(path), style).get(own) if tp > 1 else None
        if dim is not None:
            shape = list(p.shape)
            shape[dim] = -(-shape[dim] // tp)
            p = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), p.requires_grad)
        out.append(nn.ParameterList([p]))
    return out


def _device(module: nn.Module) -> torch.device:
    """Where the probe makes what the model's meta tensors stand for (the model's own device)."""
    for t in module.parameters():
        if not t.is_meta:
            return t.device
    return torch.device("cpu")
