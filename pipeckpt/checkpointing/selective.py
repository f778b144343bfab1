"""Selective activation checkpointing (SAC) on torch's own ``create_selective_checkpoint_contexts``.

The policy keeps the outputs of matrix products and fused attention kernels, and recomputes the rest.
Why torch's non-reentrant ``checkpoint`` here and not the stage's own ``_Recompute``: SAC hands back
kept outputs without autograd history, which would cut the graph ``_Recompute`` rebuilds; torch's
checkpoint only refills the forward graph's saved tensors, so gradients stay bitwise equal to
``never`` (docs/DESIGN.md, checkpointing/selective).
"""

import functools
import types
import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Iterator, List, Sequence, Tuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pipeckpt._compat import sac_saved_ops, sac_stateful_ops

__all__ = ["policy", "run_selective", "selective_region"]

_warned = False  # _eagerly said so once
_codes: Dict[type, types.CodeType] = {}  # selective_region's code, one per layer class


@functools.cache
def _saved_ops() -> FrozenSet[Any]:
    return frozenset(sac_saved_ops())


@functools.cache
def _stateful_ops() -> FrozenSet[Any]:
    return frozenset(sac_stateful_ops())


def compiled_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """:func:`policy`, and keep the outputs of the batch-norm kernels: in a compiled region the
    backward would recompute them from running statistics that the next micro-batch's forward has
    updated in place (eager SAC restores them around its recompute instead)."""
    if getattr(op, "overloadpacket", op) in _stateful_ops():
        return CheckpointPolicy.MUST_SAVE
    return policy(ctx, op, *args, **kwargs)


def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of matrix products and attention kernels, recompute everything else."""
    if getattr(op, "overloadpacket", op) in _saved_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def _both(first: ContextManager[Any], second: ContextManager[Any]) -> Iterator[None]:
    with ExitStack() as stack:
        stack.enter_context(first)
        stack.enter_context(second)
        yield


def run_selective(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Dict[str, Any],
    *,
    recompute_guard: Callable[[], ContextManager[Any]],
) -> Any:
    """``fn(*args, **kwargs)`` under SAC with :func:`policy`; ``recompute_guard()`` is entered around the
    recompute (the stage restores module state there, e.g. BatchNorm statistics)."""

    def contexts() -> Tuple[ContextManager[Any], ContextManager[Any]]:
        forward, recompute = create_selective_checkpoint_contexts(policy)
        # The guard outside SAC's dispatch mode: its own copies of module state are no ops of the region.
        return forward, _both(recompute_guard(), recompute)

    return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, preserve_rng_state=True, **kwargs)


def _eagerly(fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """A compiled region that Dynamo ran eagerly (it gave up on the frame, e.g. past its recompile
    limit): the layer's plain forward, its graph kept whole; not eager SAC, whose recompute would
    rerun the layer's state updates (BatchNorm's statistics) that the stage's guard is not there for."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "a selective stage's compiled layer ran eagerly (torch.compile gave up on it; TORCH_LOGS="
            "recompiles says why): it keeps all its activations, as checkpoint='never' would",
            stacklevel=2,
        )
    return fn(*args, **kwargs)


def _compiled_contexts() -> Tuple[ContextManager[Any], ContextManager[Any]]:
    # one function for every region: Dynamo guards on its identity, and a closure per layer would
    # cost a recompile per layer (past torch's limit of 8: eager again)
    return create_selective_checkpoint_contexts(compiled_policy)


def selective_region(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under torch's checkpoint with :func:`policy`, made to be compiled
    (:mod:`pipeckpt.checkpointing.compiling`): Dynamo traces the checkpoint as one region of the
    graph and AOTAutograd's partitioner applies the policy, so a step runs no Python per op. What
    the stage's eager run adds (the recompute guard, the layer streams) has no place there and no
    need: the partitioner recomputes no op that writes state (BatchNorm's statistics) and saves
    the random ops' outputs or replays their generator state."""

    def region(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return _eagerly(fn, args, kwargs)
        return checkpoint(
            fn, *args, use_reentrant=False, context_fn=_compiled_contexts, preserve_rng_state=True, **kwargs
        )

    # Dynamo keeps graphs, and counts recompiles against its limit of 8, per code object: one per
    # layer class, as compiling ``layer.forward`` itself gets (identical layers share a graph).
    code = _codes.setdefault(type(getattr(fn, "__self__", fn)), region.__code__.replace())
    own = types.FunctionType(code, region.__globals__, region.__name__, None, region.__closure__)
    return functools.wraps(fn)(own)


def saved_op_names() -> List[str]:
    """The names of the ops :func:`policy` keeps, for messages and docs."""
    return sorted(str(op) for op in _saved_ops())
