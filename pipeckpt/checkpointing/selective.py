"""Selective activation checkpointing (SAC) on torch's own ``create_selective_checkpoint_contexts``.

The policy keeps the outputs of matrix products and fused attention kernels, and recomputes the rest.
Why torch's non-reentrant ``checkpoint`` here and not the stage's own ``_Recompute``: SAC hands back
kept outputs without autograd history, which would cut the graph ``_Recompute`` rebuilds; torch's
checkpoint only refills the forward graph's saved tensors, so gradients stay bitwise equal to
``never`` (docs/DESIGN.md, checkpointing/selective).
"""

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pipeckpt._compat import sac_saved_ops

__all__ = ["policy", "run_selective"]

_saved: Optional[FrozenSet[Any]] = None


def _saved_ops() -> FrozenSet[Any]:
    global _saved
    if _saved is None:
        _saved = frozenset(sac_saved_ops())
    return _saved


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


def saved_op_names() -> List[str]:
    """The names of the ops :func:`policy` keeps, for messages and docs."""
    return sorted(str(op) for op in _saved_ops())
