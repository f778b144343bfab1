"""Every reach into torch.distributed's private names and behaviours: the pipelining stage's
methods the engine overrides and its schedule IR, FSDP2's lazy init and DeviceMesh's and DTensor's
layout helpers (split from torch_private.py, which holds the rest).

Each entry says why no public API serves; ``tests/test_compat_distributed.py`` checks each by name
and behaviour.
"""

from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple

from torch import nn
from torch.distributed.pipelining import PipelineStage

__all__ = [
    "BACKWARD_ONE_CHUNK",
    "BWD_SEND",
    "FORWARD_ONE_CHUNK",
    "NOSYNC_BACKWARD",
    "STAGE_META",
    "STAGE_META_HOOKS",
    "live_op_order",
    "local_extent",
    "make_fsdp_root",
    "reducing_in_backward",
    "schedule_op_order",
    "split_mesh_dim",
]


def schedule_op_order(
    schedule_cls: Any, *, stages: int, microbatches: int
) -> Optional[Dict[int, List[Tuple[str, int]]]]:
    """The compute actions (``"F"`` or ``"B"``, micro-batch) of each rank of a single-stage torch
    schedule, in torch's own schedule IR (``_get_pipeline_order``), or None where the class has none.
    The public ``pipeline_order`` is set only on a schedule built around a live ``PipelineStage`` in
    an initialised process group; the IR itself needs only the two counts."""
    order_of = getattr(schedule_cls, "_get_pipeline_order", None)
    if order_of is None:
        return None
    order = order_of(SimpleNamespace(_num_stages=stages, _n_microbatches=microbatches))
    if order is None:
        return None
    out: Dict[int, List[Tuple[str, int]]] = {}
    for rank, actions in order.items():
        out[rank] = [
            (a.computation_type.value, int(a.microbatch_index))
            for a in actions
            if a is not None and a.computation_type.value in ("F", "B") and a.microbatch_index is not None
        ]
    return out


def live_op_order(schedule: Any) -> List[Tuple[int, str, int]]:
    """The compute actions (stage index, ``"F"``/``"B"``/``"I"``/``"W"``, micro-batch) that a live
    multi-stage torch schedule runs on its own pipeline rank, in order: its public
    ``pipeline_order`` holds torch's private ``_Action`` tuples, read here by field name."""
    out: List[Tuple[int, str, int]] = []
    for action in schedule.pipeline_order[schedule.rank]:
        if action is None or action.microbatch_index is None:
            continue
        kind = str(action.computation_type.value)
        out.append((int(action.stage_index), kind, int(action.microbatch_index)))
    return out


# A schedule calls PipelineStage.forward_one_chunk for every micro-batch and runs the
# module elsewhere for shape inference; overriding it is the only way to tell the two
# apart (no public hook sees the micro-batch index).
FORWARD_ONE_CHUNK = "forward_one_chunk"
# Likewise, the local backward of one micro-batch (its input and weight parts), which the
# engine overrides to tell a stage's own errors from a peer's failure.
BACKWARD_ONE_CHUNK = ("backward_one_chunk", "backward_weight_one_chunk")
# The input gradients of a micro-batch's backward wait in ``bwd_cache`` until ``get_bwd_send_ops``
# sends them; overriding it is the one place to make them contiguous before they go (no public hook).
BWD_SEND = ("get_bwd_send_ops", "bwd_cache")
# A micro-batch's backward under FSDP2: torch's stage sets these three on its FSDP module in
# ``backward_maybe_with_nosync`` (each to False: no reduce-scatter, no reshard until the step's
# ``perform_reduce_grad``); no argument or hook keeps FSDP2's own behaviour for one backward.
NOSYNC_BACKWARD = (
    "backward_maybe_with_nosync",
    ("set_is_last_backward", "set_reshard_after_backward", "set_requires_gradient_sync"),
)


@contextmanager
def reducing_in_backward(module: nn.Module, *, reshard: bool = True) -> Iterator[None]:
    """Within it, ``module`` (an FSDP2 module) reduce-scatters each unit's gradient in its backward,
    as FSDP2 does alone, whatever torch's stage sets for its backward: the gradient sync of
    :data:`NOSYNC_BACKWARD` is set to True and held there; with ``reshard``, the other two setters
    too (a unit resharded after its backward, the backward the step's last), else left to the stage
    (gathered units kept for the next micro-batch, the step's end still to come)."""
    setters = NOSYNC_BACKWARD[1] if reshard else ("set_requires_gradient_sync",)
    for name in setters:
        getattr(module, name)(True)
    for name in setters:
        module.__dict__[name] = _ignored
    try:
        yield
    finally:
        for name in setters:
            module.__dict__.pop(name, None)


def _ignored(*args: Any, **kwargs: Any) -> None:
    return None


# Shape inference hands a stage's output shapes to the next process through these two; overriding
# them is the only way to send the output's pytree structure along (no public hook carries metadata).
STAGE_META = ("_send_meta", "_recv_meta")
# Older releases (torch 2.11 has neither) infer shapes in one method with no hook for metadata, and
# their stages lose the input gradients the distributed engine hands back: it refuses them.
STAGE_META_HOOKS = all(hasattr(PipelineStage, name) for name in STAGE_META)


def make_fsdp_root(module: nn.Module) -> None:
    """Makes ``module`` (an FSDP2 module) the root of the FSDP modules below it now, as its first
    forward would (FSDP's lazy init: its state's ``_lazy_init``, which no public API runs)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard.state(module)._lazy_init()  # type: ignore[attr-defined]


def split_mesh_dim(mesh: Any, sizes: Tuple[int, ...], names: Tuple[str, ...]) -> Any:
    """The 1-D DeviceMesh ``mesh`` viewed as a mesh of shape ``sizes`` (row-major, last innermost)
    named ``names``, on the same root mesh (so DTensors on it and on the root's other dimensions
    compose), its groups made now (a collective of every rank). FSDP2's hybrid sharding takes a 2-D
    (replicate, shard) mesh; torch has no public way to make one from a dimension of an existing
    mesh (``DeviceMesh._unflatten``), and ``init_device_mesh`` would make a second root."""
    return mesh._unflatten(0, sizes, names)


def local_extent(t: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """The shape of this rank's shard of the DTensor ``t`` and its offset in the whole tensor, from the
    layout alone (no collective): what lets a rank read only its slice of a checkpointed tensor.
    torch computes it for DCP (``torch.distributed.tensor._utils``) and offers no public API."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)
