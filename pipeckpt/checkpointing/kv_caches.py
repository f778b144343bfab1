"""A pipelined layer call with gradients runs without the key/value cache its model hands it.

A Hugging Face model builds a fresh KV cache per forward when ``use_cache`` is on (its
configs' default) and passes it to every layer, which appends the layer's keys and values
to it. A recompute runs the layer again with that cache, now holding what the forward put
in: it appends twice, so recomputes compute other gradients and torch's selective
checkpointing meets ops the forward never ran (HF's own checkpointing drops it too). Here it
is dropped in every mode, not only from recomputed calls: attention over the cache's copy of
the keys rounds differently from attention over the keys themselves, and the modes must stay
bitwise equal. Without gradients (evaluation, generation) the cache works as written.
"""

from typing import Any, Callable, Dict, Tuple

__all__ = ["without_kv_caches"]

_is_cache: Dict[type, bool] = {}


def _kv_cache(x: Any) -> bool:
    kind = type(x)
    known = _is_cache.get(kind)
    if known is None:
        # By name, not isinstance: pipeckpt does not import transformers.
        known = _is_cache[kind] = any(
            c.__name__ == "Cache" and c.__module__ == "transformers.cache_utils" for c in kind.__mro__
        )
    return known


def without_kv_caches(
    fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``(args, kwargs)`` of a recomputed call of ``fn`` (a layer's bound ``forward``), each Hugging
    Face ``Cache`` among them replaced by None: the very objects when there is none."""
    if getattr(getattr(fn, "__self__", None), "_can_checkpoint_with_cache", False):
        return args, kwargs  # a layer that only reads the cache: the recompute reads the same
    if any(_kv_cache(a) for a in args):
        args = tuple(None if _kv_cache(a) else a for a in args)
    if any(_kv_cache(v) for v in kwargs.values()):
        kwargs = {k: None if _kv_cache(v) else v for k, v in kwargs.items()}
    return args, kwargs
