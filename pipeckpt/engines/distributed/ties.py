"""Weights tied across processes: one logical parameter held by several pipeline ranks.

A tied embedding and LM head put one ``Parameter`` into the first and the last stage, two processes.
As Megatron's embedding group does, the copies stay one parameter: a process group per tie, a
broadcast when the stages are built, each step's gradients summed over the group, clipping and the
checkpoint counting it once. :class:`Replicas` is the same one axis over, for ``pipeline_of`` with
``dp > 1``; why not DDP there: a rank also holds parameters outside its stage modules, which DDP
wrapping a stage would not see (docs/DESIGN.md, engines/distributed/ties).
"""

from dataclasses import dataclass
from functools import partial
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeckpt.engines.distributed.kept_groups import kept
from pipeckpt.engines.distributed.topology import Topology
from pipeckpt.stages.partition import StagePlan, split

__all__ = ["Replicas", "Ties", "find_ties", "held_by_stages", "replicas_of"]

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
    return _ties(module, stages_of, params, topology, rank)


def held_by_stages(
    module: nn.Module, root: nn.Module, stages: Dict[str, Tuple[int, ...]], *, topology: Topology, rank: int
) -> Ties:
    """Parameters of ``root`` (by their names there) each held by the ``stages`` given (those of a
    module pipeline outside its layers: the stages that read them, ``.outside_parts``): a tie each
    where they are on several pipeline ranks, whose lowest rank holds the copy the others start from."""
    params = {id(p): p for p in dict(root.named_parameters()).values()}
    by_name = dict(root.named_parameters())
    return _ties(module, {id(by_name[n]): set(js) for n, js in stages.items()}, params, topology, rank)


def _ties(
    module: nn.Module,
    stages_of: Dict[int, Set[int]],
    params: Dict[int, nn.Parameter],
    topology: Topology,
    rank: int,
) -> Ties:
    """The ties among ``params`` held by several pipeline ranks (``stages_of``: by id, the stages
    holding each); their process groups made in the same order on every rank, as ``new_group`` needs."""
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
            for t in range(topology.tp):  # one group per tensor-parallel rank: each holds its own split
                ranks = [topology.global_rank(replica, r, t) for r in holders]
                group = kept(("group", tuple(ranks)), partial(dist.new_group, ranks))  # kept_groups: why
                if rank in ranks:
                    mine.append(_Tie(name, params[i], stages, group, src=ranks[0], primary=rank == ranks[0]))
    return Ties(mine)


# Gradients averaged in flat buckets of at most this many bytes: one collective per bucket rather
# than one per tensor (DDP's default bucket size).
_BUCKET_BYTES = 25 * 2**20


class Replicas:
    """The tensors this rank holds (not on the meta device) as copies of the same tensors on the ranks
    of the same pipeline position in the other data-parallel replicas (``group``, of ``size``)."""

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup, src: int, size: int) -> None:
        self.params = [p for p in module.parameters() if not p.is_meta]  # one entry per parameter
        self.buffers = [b for b in module.buffers() if not b.is_meta]
        self.group, self.src, self.size = group, src, size

    def broadcast(self, skip: Set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Every replica starts from replica 0's parameters and buffers (global rank ``src``), as DDP
        makes its module's: the same seed alone does not promise the same weights (a model may draw
        them per rank, or load them on rank 0 only). ``skip``: ids of tensors every replica reads from
        the same checkpoint later (receiving them would touch every page of tensors about to be sharded)."""
        with torch.no_grad():
            for t in (*self.params, *self.buffers):
                if id(t) not in skip:
                    dist.broadcast(t.data, src=self.src, group=self.group)

    def average(self, gradients: List[Gradient]) -> List[Gradient]:
        """``gradients`` of one step, each the mean over the replicas' copies. A parameter that some
        replica gave no gradient counts zero there; one that none did stays without."""
        where: Dict[int, int] = {id(p): i for i, (p, _) in enumerate(gradients)}
        trained = [p for p in self.params if p.requires_grad]
        present = torch.tensor([id(p) in where for p in trained], dtype=torch.uint8)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
        out = list(gradients)
        reduced: List[Tensor] = []
        for p, anywhere in zip(trained, present.tolist()):
            if not anywhere:
                continue
            i = where.get(id(p))
            if i is None:
                out.append((p, torch.zeros_like(p)))
                i = len(out) - 1
            reduced.append(out[i][1])
        for bucket in _buckets(reduced):
            # Hand-written flattening: torch's own (torch._utils._flatten_dense_tensors, DDP's
            # reducer) is private or bound to a module's parameters.
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.size)
            for g, piece in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(piece.view_as(g))
        return out


def replicas_of(module: nn.Module, group: dist.ProcessGroup, size: int, skip: Set[int]) -> Replicas:
    """``module``'s tensors as copies over the replicas' ``group`` (of ``size``), every one starting
    from replica 0's: the group's first rank, not ``pipeline_rank`` under ``tp > 1``. ``skip``: as
    :meth:`Replicas.broadcast`'s."""
    replicas = Replicas(module, group=group, src=dist.get_global_rank(group, 0), size=size)
    replicas.broadcast(skip=skip)
    return replicas


def _buckets(grads: Sequence[Tensor]) -> Iterator[List[Tensor]]:
    """``grads`` in order, cut into runs of one dtype and device, each of at most ``_BUCKET_BYTES``
    (or one tensor larger than that)."""
    bucket: List[Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (
            g.dtype != bucket[0].dtype or g.device != bucket[0].device or size + nbytes > _BUCKET_BYTES
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket
