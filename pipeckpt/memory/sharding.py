"""One rank's memory under FSDP2 and tensor parallelism: sharded state, gathered parameters, precision.

Why a rule and not a profile: what FSDP2 keeps per rank follows from each parameter's shape alone
(``fully_shard`` splits dim 0 into ``ceil(rows / degree)``-row shards, the last padded), while
activations stay measured: a tensor-parallel rank's block is profiled as the narrower block it
computes (``pipeckpt.app.models.llama``, ``tensor_parallel``). ``rank_peak.per_rank`` puts the two
together on a stage's predicted peak. docs/MEMORY.md, "Per rank under FSDP2, TP and PP", states the
rules.
"""

import functools
import itertools
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.tensor_parallel import under_fsdp
from pipeckpt.memory.optimizer_state import optimizer_state_bytes
from pipeckpt.memory.outside_share import OutsideParam, sharded_share, units
from pipeckpt.memory.split_dims import split_dims

__all__ = [
    "Layout",
    "RankState",
    "PRECISIONS",
    "shard_numel",
    "stage_rank_states",
    "split_shapes",
    "rank_state",
    "reduced_in_backward",
    "reduced_every_microbatch",
]

#: Lightning's precision names: (compute dtype, master dtype of parameters, gradients and optimizer).
PRECISIONS: Dict[str, Tuple[torch.dtype, torch.dtype]] = {
    "32-true": (torch.float32, torch.float32),
    "32": (torch.float32, torch.float32),
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "16-mixed": (torch.float16, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
}


@dataclass(frozen=True)
class Layout:
    """How one pipeline stage's parameters are spread over ranks.

    Args:
        fsdp: FSDP2's shard degree (1: no sharding, every rank holds the stage whole).
        tp: tensor-parallel degree (the stage's layers must already be one rank's share).
        reshard_after_forward: FSDP2 frees a block's gathered parameters after its forward (True) or
            keeps the stage's for the whole step (False, torchtitan's default under PP).
        reduce_every_microbatch: FSDP2 reduce-scatters each unit's gradient in every micro-batch's
            backward (True: shards only, :func:`reduced_every_microbatch`) or, as torch's pipeline
            stage does, once after the last (False: the stage's gradients whole until then).
        precision: a key of :data:`PRECISIONS`.
        tp_plan: ``tensor_parallel_plan``'s entries (submodule pattern, ``"colwise"`` or
            ``"rowwise"``) that split whole layers' parameters into one rank's share; empty: the
            layers counted are one rank's share already.
        sequence_parallel: each layer's norms and residual stream split along the sequence over
            ``tp`` too (profiled so: :mod:`pipeckpt.memory.sequence_local`).
        gloo: the ranks reduce over gloo (a CPU run), whose reduce-scatter stages its input in a
            copy of the same bytes and may free that copy after the call has returned
            (``RankState.staged``; tests/memory/test_gloo_staging.py). NCCL makes none.
    """

    fsdp: int = 1
    tp: int = 1
    reshard_after_forward: bool = False
    precision: str = "32-true"
    tp_plan: Tuple[Tuple[str, str], ...] = ()
    reduce_every_microbatch: bool = False
    sequence_parallel: bool = False
    gloo: bool = False

    def __post_init__(self) -> None:
        for name in ("fsdp", "tp"):
            if getattr(self, name) < 1:
                raise config_error(
                    f"{name}={getattr(self, name)}", "a degree is at least 1", f"set {name}=1 or more"
                )
        if self.precision not in PRECISIONS:
            raise config_error(
                f"precision {self.precision!r}",
                f"the memory model knows {list(PRECISIONS)}",
                "use one of those",
            )

    @property
    def under_fsdp(self) -> bool:
        """Whether FSDP2 wraps the stage, as the distributed engine decides it (at any shard degree
        under tensor parallelism: :func:`~pipeckpt.engines.distributed.tensor_parallel.under_fsdp`)."""
        return under_fsdp(self.fsdp, self.tp)

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision][0]

    @property
    def master_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision][1]


@dataclass(frozen=True)
class RankState:
    """Bytes of one rank's share of a stage's training state (rank 0: the largest shards)."""

    params: int  # master parameters, sharded (frozen ones too)
    grads: int  # the trained ones' gradients, sharded, after the reduce-scatter
    optimizer: int  # optimizer state of the trained sharded parameters
    unsharded: int  # compute-dtype parameters gathered and held at the peak
    collectives: int  # buffers of one layer's backward (rank_state says which)
    # compute-dtype parameters gathered and held once the backward has begun (None: ``unsharded``).
    # torch's PipelineStage turns FSDP2's reshard after backward off for every micro-batch
    # (``backward_maybe_with_nosync``) until the step's ``perform_reduce_grad``, so under
    # ``reshard_after_forward`` a unit gathered again for its backward stays gathered; before the
    # first backward none is (rank_peak._LOSS).
    unsharded_backward: Optional[int] = None
    # gradients held once every unit's backward has run, before the step reduces them (None:
    # ``grads``). The same call turns gradient sync off, so the stage's units keep their whole
    # gradients in the reduce dtype until ``perform_reduce_grad`` (tests/memory/
    # test_fsdp_no_sync_gradients.py); a module outside the layers, a root of its own, reduces its
    # gradient every micro-batch and keeps its shard.
    grads_backward: Optional[int] = None
    # the step's deferred reduction: every whole gradient still held beside one unit's reduce-scatter
    # input, FSDP2's copy of it (``foreach_reduce``) before it frees them.
    reducing: int = 0
    # buffers of the backward of a unit outside the layers: its gradient and reduce-scatter input.
    outside_collectives: int = 0
    # one layer's gradient and reduce-scatter input, the buffers of a layer's backward that reduces
    # (reduced_in_backward).
    synced_collectives: int = 0
    # gloo's staging copy of the largest reduce-scatter input a backward runs (a unit outside the
    # layers every micro-batch; the layers too where they reduce in it), which gloo may free after
    # its call has returned: an op after it can still hold it (Layout.gloo). 0 on NCCL.
    staged: int = 0
    # the same of the step's deferred reduction: a unit's copy beside the next unit's buffers.
    staged_reducing: int = 0


def reduced_in_backward(state: RankState) -> RankState:
    """``state`` where each unit's gradient is reduce-scattered in its own backward, as FSDP2 does
    alone and the engine lets it for a stage that runs one micro-batch a step
    (engines/distributed/wiring.py, ``LiveStage.backward_maybe_with_nosync``): shards only, one
    unit's buffers in a backward, and a unit resharded after its backward."""
    return replace(
        reduced_every_microbatch(state),
        # resharded after its backward: two units at most, none at a loss (memory/gathered.py)
        unsharded_backward=None if state.unsharded_backward is None else state.unsharded,
    )


def reduced_every_microbatch(state: RankState) -> RankState:
    """``state`` where each unit's gradient is reduce-scattered in every micro-batch's backward
    (``reduce_every_microbatch``): shards only, no deferred reduction, one unit's gradient and
    reduce-scatter input in a layer's backward; the units a backward gathered are kept as torch's
    stage keeps them (its reshard after backward stays off until the step's end)."""
    if state.grads_backward is None:
        return state  # no FSDP: nothing deferred
    return replace(
        state,
        grads_backward=None,
        reducing=0,
        collectives=state.synced_collectives,
        staged=max(state.staged, state.staged_reducing),
        staged_reducing=0,
    )


def shard_numel(shape: Sequence[int], degree: int) -> int:
    """Elements of rank 0's FSDP2 shard of a parameter of ``shape``: dim 0 cut in ``degree`` chunks
    as ``torch.chunk`` cuts it, every shard padded to the first chunk's rows.

    Args:
        shape: the parameter's shape (one tensor-parallel rank's local shape).
        degree: the shard degree.
    """
    if not shape:
        return 1
    rows = -(-int(shape[0]) // degree)
    rest = 1
    for d in shape[1:]:
        rest *= int(d)
    return rows * rest


def split_shapes(unit: nn.Module, layout: Layout) -> List[Tuple[Tuple[int, ...], bool]]:
    """One tensor-parallel rank's shape of each parameter of ``unit`` under ``layout.tp_plan``, and
    whether it is trained (the first pattern that matches a submodule's path picks its style, as the
    engine applies it; a split dimension keeps ``torch.chunk``'s first share).

    Args:
        unit: one layer, whole.
        layout: its degrees and tensor-parallel plan.
    """
    dims: Dict[int, int] = {}
    for name, module in unit.named_modules():
        style = next((st for pattern, st in layout.tp_plan if name and fnmatch(name, pattern)), None)
        split = split_dims(module, style)
        for pname, p in module.named_parameters(recurse=False):
            if pname in split:
                dims[id(p)] = split[pname]
    shapes = []
    for p in unit.parameters():
        shape = list(p.shape)
        if id(p) in dims and layout.tp > 1:
            shape[dims[id(p)]] = -(-shape[dims[id(p)]] // layout.tp)
        shapes.append((tuple(shape), p.requires_grad))
    return shapes


def rank_state(
    units: Sequence[nn.Module],
    layout: Layout,
    optimizer: Union[str, torch.optim.Optimizer, type] = "adamw",
    outside: Sequence[nn.Module] = (),
) -> RankState:
    """The training state one rank holds for a stage whose ``units`` are each wrapped by ``fully_shard``.

    "collectives" are the buffers of one layer's backward: under mixed precision the largest of
    ``units``' compute-dtype gradient before FSDP2 upcasts it to the one it accumulates
    (``to_accumulated_grad_if_needed``); nothing else, as no reduce-scatter runs before the step's
    end. An ``outside`` unit's backward holds its gradient and its reduce-scatter input.

    Args:
        units: the stage's layers, one FSDP2 unit each (torchtitan wraps every block), reduced once a
            step, at its end (``RankState.grads_backward``).
        layout: degrees, reshard policy and precision.
        optimizer: whose state to count (:func:`~pipeckpt.memory.optimizer_state.optimizer_state_bytes`).
        outside: units outside the stage's module, each a root of its own that reduces its
            gradient every micro-batch (a ``pipeline_of`` model's embedding or head).
    """
    master = torch.empty((), dtype=layout.master_dtype).element_size()
    compute = torch.empty((), dtype=layout.compute_dtype).element_size()
    shapes = [split_shapes(unit, layout) for unit in (*units, *outside)]
    params = [shape for unit in shapes for shape, trained in unit if trained]
    sharded = sum(shard_numel(shape, layout.fsdp) for shape in params) * master
    # Frozen parameters are sharded and held like the rest, with no gradient and no optimizer state.
    held = sharded + sum(shard_numel(s, layout.fsdp) for u in shapes for s, t in u if not t) * master
    if not layout.under_fsdp:  # no FSDP: the master parameters are the ones computed with
        return RankState(held, sharded, optimizer_state_bytes(optimizer, sharded, len(params)), 0, 0)
    gathered = [sum(shard_numel(shape, layout.fsdp) * layout.fsdp for shape, _ in u) for u in shapes]
    largest = max(gathered, default=0)
    gathered_held = 2 * largest if layout.reshard_after_forward else sum(gathered)  # running + prefetched
    whole = [sum(shard_numel(s, layout.fsdp) * layout.fsdp for s, t in u if t) for u in shapes]
    deferred, own = whole[: len(units)], whole[len(units) :]
    own_shards = sum(shard_numel(s, layout.fsdp) for u in shapes[len(units) :] for s, t in u if t)
    upcast = max(deferred, default=0) * compute if compute != master else 0
    # a reduce-scatter's buffers: its gradient as copied in, and its input; on gloo the input and its
    # staging copy inside the call, the gradient freed by then (no call at a shard degree of 1: FSDP2
    # copies the input to its output)
    scattered = layout.gloo and layout.fsdp > 1
    copied_in = master + (max(compute, master) if scattered else compute)
    staged = master if scattered else 0
    state = RankState(
        params=held,
        grads=sharded,
        optimizer=optimizer_state_bytes(optimizer, sharded, len(params)),
        unsharded=gathered_held * compute,
        collectives=upcast,
        unsharded_backward=sum(gathered) * compute if layout.reshard_after_forward else None,
        grads_backward=(sum(deferred) + own_shards) * master,
        reducing=max(deferred, default=0) * master,
        outside_collectives=max(own, default=0) * copied_in,
        synced_collectives=max(deferred, default=0) * copied_in,
        staged=max(own, default=0) * staged,
        staged_reducing=max(deferred, default=0) * staged,
    )
    return reduced_every_microbatch(state) if layout.reduce_every_microbatch else state


def stage_rank_states(
    sequential: nn.Sequential,
    layout: Layout,
    optimizer: Union[str, torch.optim.Optimizer],
    outside: Optional[Sequence[OutsideParam]] = None,
) -> Callable[[Tuple[int, ...]], List[Tuple[RankState, RankState]]]:
    """Each stage's state on one of its ranks and unsharded, per balance: every layer an FSDP2 unit,
    as the distributed engine shards a stage, and of a ``pipeline_of`` model's parameters outside
    the layers (``outside``), each one that the stage alone holds (memory/outside_share.py). The
    unsharded state counts those whole, as the walk counts them: split over the vocabulary there too,
    it was short by the part of the embedding and head a rank does not hold, which
    :func:`~pipeckpt.memory.rank_peak.on_rank` then added back as "beyond the layers" (the layout
    search's tensor-parallel ranks over by that, three times over with AdamW: +18 MiB, +11%, on the
    measured Llama at tp 4)."""
    layers = list(sequential)
    unsharded = Layout(precision=_as_built(layers, layout.precision))
    root: Optional[nn.Module] = getattr(sequential, "root", None)

    @functools.cache
    def states(balance: Tuple[int, ...]) -> List[Tuple[RankState, RankState]]:
        edges = [0, *itertools.accumulate(balance)]
        ranges = list(itertools.pairwise(edges))
        alone = [a for a, _ in sharded_share(outside, ranges)] if outside and root is not None else []
        out = []
        for j, (a, b) in enumerate(ranges):
            held = units(root, alone[j], layout.tp_plan, layout.tp) if alone and root is not None else []
            built = units(root, alone[j]) if alone and root is not None else []  # as the walk counts them
            out.append(
                (
                    rank_state(layers[a:b], layout, optimizer, held),
                    rank_state([*layers[a:b], *built], unsharded, optimizer),
                )
            )
        return out

    return states


def _as_built(layers: Sequence[nn.Module], precision: str) -> str:
    """The precision whose parameter dtype is the one ``layers`` were built in: the dtype the walk
    counted their parameters and optimizer state in, which ``rank_peak.on_rank`` takes off before it adds
    the rank's share (in ``precision``'s master dtype). A planner builds a mixed-precision model in its
    compute dtype (the plan's and the layout search's fake builds: bf16 under ``bf16-mixed``), where a
    fit builds it in the master dtype; counted in the master dtype, the first under-counted every
    rank by its whole model's parameters and optimizer state at half (45 GiB for Llama 3.1 8B)."""
    dtype = next((p.dtype for m in layers for p in m.parameters() if p.is_floating_point()), None)
    for name in (precision, "32-true", "bf16-true"):
        if PRECISIONS.get(name, (None, None))[1] == dtype:
            return name
    return precision
