"""One tensor-parallel rank's shapes under sequence parallelism, in one process, for profiling.

Why: the memory model profiles a layer cut to one rank (:mod:`pipeckpt.memory.tp_local`), whose
colwise and rowwise projections run one rank's features. Under sequence parallelism
(:mod:`pipeckpt.engines.distributed.sequence_parallel`) the rank also holds only its part of the
sequence outside the split blocks, and what it keeps there (each norm's input, the residual stream,
under recompute each layer's input, what crosses a stage boundary) is ``1/tp``. Hooks of the same
roles (:func:`~pipeckpt.engines.distributed.sequence_parallel.sequence_roles`) make those shapes
here: each collective as a new tensor of its output's shape, as the collective's output is:

- the model's first layer takes ``1/tp`` of its input's sequence, its last gives ``tp`` times it;
- each gathered block takes its input ``tp`` times along the sequence (the all-gather's output,
  which its colwise projections keep), each rowwise module gives ``1/tp`` of its output (the
  reduce-scatter's).

The values are not a rank's (the parts are copies of one part); only shapes and storages count.
"""

from typing import List, Mapping

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pipeckpt.engines.distributed.sequence_parallel import (
    SEQUENCE_DIM,
    check_divides,
    on_hidden,
    on_output,
    sequence_roles,
)

__all__: List[str] = []


def one_rank_sequence(layers: nn.Sequential, plan: Mapping[str, str], tp: int) -> List[RemovableHandle]:
    """Hooks on ``layers`` that give one of ``tp`` ranks' shapes under sequence parallelism by
    ``plan`` (the plan's entries inside a layer); returns them, for a caller that takes them off."""
    children = list(layers.children())
    ends = _Ends(tp)
    hooks = []
    for i, layer in enumerate(children):
        roles = sequence_roles(layer, plan)
        for child in roles.gathered:
            hooks.append(
                layer.get_submodule(child).register_forward_pre_hook(
                    on_hidden(lambda x: _whole(x, tp)), with_kwargs=True
                )
            )
        for child in roles.scattered:
            hooks.append(layer.get_submodule(child).register_forward_hook(on_output(lambda y: _part(y, tp))))
        if i == 0:
            hooks.append(layer.register_forward_pre_hook(on_hidden(ends.split), with_kwargs=True))
        if i == len(children) - 1:
            hooks.append(layer.register_forward_hook(on_output(ends.whole)))
    return hooks


class _Ends:
    """The first layer's split and the last layer's gather, each done once to a value: the profile
    of a ``pipeline_of`` model (memory/rooted.py) records each layer's call as its hooks left it
    and replays it (the first layer's input already a part, the last layer's output whole), and
    runs the model's own code again around the last layer's recorded output."""

    def __init__(self, tp: int) -> None:
        self.tp, self.full = tp, -1  # the whole sequence's length, as first seen

    def split(self, x: Tensor) -> Tensor:
        if self.full < 0:
            self.full = x.shape[SEQUENCE_DIM]
        return _part(x, self.tp) if x.shape[SEQUENCE_DIM] == self.full else x

    def whole(self, h: Tensor) -> Tensor:
        return h if h.shape[SEQUENCE_DIM] == self.full else _whole(h, self.tp)


def _part(x: Tensor, tp: int) -> Tensor:
    check_divides(x, tp)
    return x.narrow(SEQUENCE_DIM, 0, x.shape[SEQUENCE_DIM] // tp).clone()


def _whole(x: Tensor, tp: int) -> Tensor:
    return torch.cat([x] * tp, dim=SEQUENCE_DIM)
