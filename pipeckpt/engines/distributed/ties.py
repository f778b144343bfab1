"""Weights tied across processes: one logical parameter held by several pipeline ranks.

A tied input embedding and LM head put one ``Parameter`` into the first and the last
stage. Under the distributed engine those stages run in different processes, so each
of them holds a copy (:func:`~pipeckpt.engines.distributed.wiring.build_stages` keeps a
tensor that one of its stages shares off the meta device). As Megatron's embedding group
does, the copies are kept one parameter:

- the ranks of one pipeline that hold a tie get a process group of their own (one per tie
  and data-parallel replica, made on every rank in the same order, as ``new_group`` needs);
- the copies start equal: the lowest such rank broadcasts its copy when the stages are built;
- each step, before the gradients join ``.grad``, the copies' gradients of that step are summed
  over the group (the step's only, so that accumulation over several batches stays exact); the
  optimizer then makes the same update on every copy;
- clipping by norm counts a tie once (on its lowest rank), and a checkpoint holds its one key
  (every copy writes it, and the sharded writer keeps one).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeckpt.engines.distributed.topology import Topology
from pipeckpt.planning import StagePlan, split

__all__ = ["Ties", "find_ties", "held_by_every_rank"]

Gradient = Tuple[nn.Parameter, Tensor]


@dataclass
class _Tie:
    name: str  # the parameter's name in the user's module
    param: nn.Parameter
    stages: Tuple[int, ...]
    group: Optional[dist.ProcessGroup] = None  # this replica's, where this rank holds the tie
    src: int = 0  # global rank of its lowest holder in this replica
    primary: bool = False  # this rank is that holder


class Ties:
    """This rank's weights tied with stages on other pipeline ranks."""

    def __init__(self, ties: Sequence[_Tie]) -> None:
        self.ties = list(ties)

    def __bool__(self) -> bool:
        return bool(self.ties)

    def __add__(self, other: "Ties") -> "Ties":
        return Ties([*self.ties, *other.ties])

    def names(self) -> List[str]:
        return [t.name for t in self.ties]

    def broadcast(self) -> None:
        """The copies made equal: the lowest holder's values everywhere."""
        with torch.no_grad():
            for tie in self.ties:
                dist.broadcast(tie.param.data, src=tie.src, group=tie.group)

    def sum_gradients(self, gradients: List[Gradient]) -> List[Gradient]:
        """``gradients`` of one step, each tied weight's replaced by the sum over its copies."""
        where: Dict[int, int] = {id(p): i for i, (p, _) in enumerate(gradients)}
        out = list(gradients)
        for tie in self.ties:  # in the same order on every holder
            if not tie.param.requires_grad:
                continue
            i = where.get(id(tie.param))
            grad = out[i][1] if i is not None else torch.zeros_like(tie.param)
            dist.all_reduce(grad, group=tie.group)
            if i is None:
                out.append((tie.param, grad))
        return out

    def counted_once(self, grads: List[Tensor]) -> List[Tensor]:
        """``grads`` without the copies that another rank's norm already counts."""
        skip = {id(t.param.grad) for t in self.ties if not t.primary and t.param.grad is not None}
        return [g for g in grads if id(g) not in skip] if skip else grads


def find_ties(
    module: nn.Module, sequential: nn.Sequential, plan: StagePlan, topology: Topology, rank: int
) -> Ties:
    """The ties of ``sequential`` whose stages live on different pipeline ranks; makes their
    process groups (a collective: every rank calls it, before any layer moves to meta)."""
    stages_of: Dict[int, Set[int]] = {}
    params: Dict[int, nn.Parameter] = {}
    for j, part in enumerate(split(sequential, plan.balance)):
        for p in part.parameters():
            stages_of.setdefault(id(p), set()).add(j)
            params[id(p)] = p
    names: Dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    mine: List[_Tie] = []
    shared = sorted((names.get(i, ""), i) for i, js in stages_of.items() if len(js) > 1)
    for name, i in shared:
        stages = tuple(sorted(stages_of[i]))
        holders = sorted({topology.rank_of(j) for j in stages})
        if len(holders) < 2:  # one process holds every use: it is one parameter there already
            continue
        for replica in range(topology.dp):
            ranks = [replica * topology.pp + r for r in holders]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine.append(_Tie(name, params[i], stages, group, src=ranks[0], primary=rank == ranks[0]))
    return Ties(mine)


def held_by_every_rank(
    named: Sequence[Tuple[str, nn.Parameter]],
    *,
    stages: int,
    group: dist.ProcessGroup,
    src: int,
    primary: bool,
) -> Ties:
    """Parameters that every pipeline rank of this replica holds and uses (those of a module
    pipeline outside its layers): a tie each, over the replica's pipeline ``group``, whose lowest
    rank ``src`` (global) holds the copy that the others start from."""
    every = tuple(range(stages))
    return Ties([_Tie(name, p, every, group, src=src, primary=primary) for name, p in named])
