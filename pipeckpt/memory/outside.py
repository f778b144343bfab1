"""A ``pipeline_of`` model's own code outside its layers, measured as it runs: once per micro-batch.

The pipeline runs the model's ``forward`` once per micro-batch (engines/local/module.py), so the code
before the first layer (embeddings) and after the last (final norm, head, loss) runs per micro-batch:
each micro-batch keeps what that code saved (a head's log-probabilities, micro-batch x sequence x
vocabulary floats) and its outputs until they are joined, and its backward runs the head's backward
before its layers' and the embeddings' after them. Why not the chain's last link (memory/rooted.py)
under MemTracker: MemTracker charges a module what runs between its own hooks, and the embeddings'
backward (where a tied head's weight gradient is added to the embedding's) runs after the layers'.
So the model's ``forward`` runs once more with every layer passing its input straight on (no work),
under a count of live bytes marked where the layers start and end, and where the gradient reaches them.
"""

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Sequence, Set

import torch
from torch import Tensor

from pipeckpt._compat import TorchDispatchMode, tree_flatten, tree_unflatten
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.boundaries.recorded import replay

__all__ = ["OutsideMemory", "outside_memory"]


@dataclass(frozen=True)
class OutsideMemory:
    """Bytes of one micro-batch's code outside a ``pipeline_of`` model's layers.

    Args:
        after_forward: the peak of the code after the last layer (head, loss) above what was live
            when it started.
        held: what that code and the code before the layers keep from the micro-batch's forward to
            its backward, its outputs and the layers' carried value excluded.
        outputs: the model's output tensors (logits, loss), held until the micro-batches' outputs
            are joined.
        after_backward: the peak of the head's backward above what was live when it started.
        before_backward: the peak of the embeddings' backward above what was live when it started
            (a weight the head ties to the embedding: its gradient added to the head's).
        before_grads: the gradients of the parameters only the code before the layers uses (an
            untied embedding): made by the first micro-batch's embeddings' backward, and added to by
            each later one's (the sum made beside them).
        after_grads: the gradients of the parameters the code after the layers uses: each
            micro-batch's backward after the first adds to them out of place, once its own
            gradients are made.
        after_left: what the head's backward leaves above what was live when it started (its
            weight gradients made, what its forward saved freed): beside which that sum is made.
        input_saved: the bytes of the last layer's output that the code after the layers saves
            for backward (a final norm's or a head's input): held by each micro-batch from its
            forward to its backward even where its last stage keeps nothing of its own (recompute).
    """

    after_forward: int
    held: int
    outputs: int
    after_backward: int
    before_backward: int
    before_grads: int = 0
    after_grads: int = 0
    after_left: int = 0
    input_saved: int = 0


class _Live(TorchDispatchMode):
    """Live bytes of the storages created under it, and their peak since the last :meth:`mark`."""

    def __init__(self, exclude: Sequence[Tensor], params: Sequence[Tensor]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: Dict[int, Any] = {id(t.untyped_storage()): t for t in exclude}
        self._params = {id(p.untyped_storage()): p for p in params}
        self.phase = "before"  # the forward's code before the layers, or "after" them
        self.used: Dict[str, Dict[int, Tensor]] = {"before": {}, "after": {}}

    def mark(self) -> int:
        self.peak = self.live
        return self.live

    def _freed(self, key: int, size: int) -> None:
        self._seen.pop(key, None)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, Tensor) and id(t.untyped_storage()) in self._params:
                key = id(t.untyped_storage())
                self.used[self.phase][key] = self._params[key]
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                st = t.untyped_storage()
                if id(st) not in self._seen:
                    size = st.nbytes()
                    self._seen[id(st)] = weakref.ref(st, self._on_free(id(st), size))
                    self.live += size
        self.peak = max(self.peak, self.live)
        return out

    def _on_free(self, key: int, size: int) -> Callable[[Any], None]:
        """The weakref callback that counts storage ``key`` of ``size`` bytes freed."""
        return lambda _: self._freed(key, size)


def _storage_bytes(tensors: Iterator[Tensor]) -> int:
    seen = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def outside_memory(spec: ModulePipeline, call: Any, calls: List[Any]) -> OutsideMemory:
    """Runs ``spec.root`` on ``call`` (a :class:`~pipeckpt.memory.rooted.RootInput`) forward and
    backward, each layer handing the value it was carried on (``calls``: the recorded calls,
    linked) straight back, and measures :class:`OutsideMemory`. Backward starts from the 0-dim
    outputs (a loss) when there are any, else from every output with a gradient of ones."""
    root = spec.root
    layers = list(spec)
    data = [t for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, Tensor)]
    inside = {id(p) for p in spec.parameters()}
    trained = [p for p in root.parameters() if p.requires_grad and id(p) not in inside]
    live = _Live([*root.parameters(), *root.buffers(), *data], trained)
    saved_after: Set[int] = set()  # storages the code after the layers saves for backward

    def pack(t: Tensor) -> Tensor:
        if live.phase == "after":
            saved_after.add(id(t.untyped_storage()))
        return t

    marks: Dict[str, int] = {}
    carried: List[Tensor] = []

    def passing(i: int, recorded: Any) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            h = tree_flatten((args, kwargs))[0][recorded.carried_in]
            leaves = list(recorded.outputs)
            if isinstance(h, Tensor) and getattr(leaves[recorded.carried_out], "shape", None) == h.shape:
                leaves[recorded.carried_out] = h
            live.phase = "after"
            replay(recorded.recorded)  # what the layer's insides recorded (router logits)
            if i == len(layers) - 1:
                carried.append(leaves[recorded.carried_out])
                marks["head"] = live.mark()
            return tree_unflatten(leaves, recorded.output_spec)

        return forward

    for i, (layer, recorded) in enumerate(zip(layers, calls)):
        layer.forward = passing(i, recorded)
    try:
        with live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = root(*call.args, **call.kwargs)
            after_forward = live.peak - marks["head"]
            tensors = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
            outputs = _storage_bytes(t for t in tensors if t.requires_grad)
            head_input = carried[0]
            kept_input = _storage_bytes(iter([head_input])) if head_input.requires_grad else 0
            input_saved = kept_input if id(head_input.untyped_storage()) in saved_after else 0
            held = live.live - outputs - kept_input
            grads = [t for t in tensors if t.requires_grad]
            roots = [t for t in grads if t.dim() == 0] or grads
            del out, tensors, grads
            start = live.mark()
            if head_input.requires_grad:
                head_input.register_hook(lambda g: marks.__setitem__("after", live.peak - start))
                head_input.register_hook(lambda g: marks.__setitem__("left", live.live - start))
                head_input.register_hook(lambda g: marks.__setitem__("embeddings", live.mark()))
            carried.clear()
            del head_input
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
            after_backward = marks.get("after", live.peak - start)
            before_backward = live.peak - marks["embeddings"] if "embeddings" in marks else 0
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
    return OutsideMemory(
        after_forward=max(0, after_forward),
        held=max(0, held),
        outputs=outputs,
        after_backward=max(0, after_backward),
        before_backward=max(0, before_backward),
        before_grads=_storage_bytes(p for k, p in live.used["before"].items() if k not in live.used["after"]),
        after_grads=_storage_bytes(iter(live.used["after"].values())),
        after_left=marks.get("left", 0),
        input_saved=input_saved,
    )
