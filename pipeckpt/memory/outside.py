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
The same count keeps apart the bytes shaped by the vocabulary (the head's logits, what the loss makes
of them, the head's weight gradient), which tensor parallelism splits over ``tp`` where the head is
split (memory/vocab_share.py): the frontier of (other, vocabulary) bytes live at once, from which
the peak with the vocabulary's share divided by any ``tp`` follows.
"""

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import TorchDispatchMode, tree_flatten, tree_unflatten
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.boundaries.recorded import replay
from pipeckpt.memory.loss_parallel_bytes import handed_on, held_at_once

__all__ = ["OutsideMemory", "outside_memory", "vocab_sized", "peak_over"]

#: Bytes live at once, as (not shaped by the vocabulary, shaped by it).
Points = Tuple[Tuple[int, int], ...]


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
        head: the path in the model of its head (the ``nn.Linear`` outside the layers with the
            most output features: the vocabulary), "" where there is none.
        head_shape: the head's weight's shape, (vocabulary, hidden).
        forward_points: the forward's live bytes as :data:`Points` above the start (the frontier:
            none with both parts at least another's).
        backward_points: the same over the head's backward, above what was live when it started.
        split_forward_points: ``forward_points`` as a rank whose head the plan splits holds the
            bytes: its loss under ``loss_parallel`` (memory/loss_parallel_bytes.py).
        split_backward_points: ``backward_points`` so.
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
    head: str = ""
    head_shape: Tuple[int, ...] = ()
    forward_points: Points = ()
    backward_points: Points = ()
    split_forward_points: Points = ()
    split_backward_points: Points = ()


def vocab_sized(shape: Sequence[int], head_shape: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` is shaped by the vocabulary of a head of weight ``head_shape``:
    its last dimension is the head's output features (logits, log-probabilities, their gradients),
    or it is the head's weight's shape (its gradient). Tensor parallelism splits both over ``tp``."""
    return (
        bool(head_shape) and bool(shape) and (shape[-1] == head_shape[0] or tuple(shape) == tuple(head_shape))
    )


def peak_over(points: Points, tp: int = 1) -> int:
    """The most bytes live at once among ``points`` with the vocabulary's part split over ``tp``
    ranks (rank 0's share: ``ceil``)."""
    return max((other - (-vocab // tp) for other, vocab in points), default=0)


def _head(spec: ModulePipeline) -> Tuple[str, Tuple[int, ...]]:
    """The path and weight shape of the ``nn.Linear`` outside ``spec``'s layers with the most output
    features (a language model's head), ``("", ())`` where there is none."""
    inside = {id(m) for layer in spec for m in layer.modules()}
    linears = [
        (n, m) for n, m in spec.root.named_modules() if isinstance(m, nn.Linear) and id(m) not in inside
    ]
    if not linears:
        return "", ()
    name, head = max(linears, key=lambda pair: pair[1].out_features)
    return name, tuple(head.weight.shape)


class _Frontier:
    """The (other, vocabulary) bytes seen live at once that no other point seen has both parts of at
    least: enough for the peak under any split of the vocabulary's part (:func:`peak_over`)."""

    def __init__(self) -> None:
        self.points: List[Tuple[int, int]] = []

    def see(self, other: int, vocab: int) -> None:
        if any(o >= other and v >= vocab for o, v in self.points):
            return
        self.points = [(o, v) for o, v in self.points if o > other or v > vocab]
        self.points.append((other, vocab))

    def above(self, other: int, vocab: int) -> Points:
        return tuple(sorted((o - other, v - vocab) for o, v in self.points))


class _Live(TorchDispatchMode):
    """Live bytes of the storages created under it, and their peak since the last :meth:`mark`;
    beside the frontier of aten's ops, ``split`` holds the same bytes as a rank whose head the plan
    splits holds them under ``loss_parallel`` (memory/loss_parallel_bytes.py)."""

    def __init__(
        self, exclude: Sequence[Tensor], params: Sequence[Tensor], head_shape: Tuple[int, ...] = ()
    ) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.vocab = 0  # of ``live``, the bytes shaped by the head's vocabulary (:func:`vocab_sized`)
        self.split_vocab = 0  # the same under loss_parallel
        self.head_shape = head_shape
        self.frontier = _Frontier()
        self.split = _Frontier()
        self._seen: Dict[int, Any] = {id(t.untyped_storage()): t for t in exclude}
        self._split_bytes: Dict[int, int] = {}  # each vocabulary-shaped storage's bytes under loss_parallel
        self._params = {id(p.untyped_storage()): p for p in params}
        self.phase = "before"  # the forward's code before the layers, or "after" them
        self.used: Dict[str, Dict[int, Tensor]] = {"before": {}, "after": {}}

    def mark(self) -> int:
        self.peak = self.live
        return self.live

    def restart(self) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """New frontiers from what is live now, each's start returned as (other, vocabulary) bytes."""
        other = self.live - self.vocab
        self.frontier, self.split = _Frontier(), _Frontier()
        self.frontier.see(other, self.vocab)
        self.split.see(other, self.split_vocab)
        return (other, self.vocab), (other, self.split_vocab)

    def _freed(self, key: int, size: int, vocab: bool) -> None:
        self._seen.pop(key, None)
        self.live -= size
        self.vocab -= size if vocab else 0
        self.split_vocab -= self._split_bytes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, Tensor) and id(t.untyped_storage()) in self._params:
                key = id(t.untyped_storage())
                self.used[self.phase][key] = self._params[key]
        if isinstance(out, Tensor) and vocab_sized(out.shape, self.head_shape):
            at_once = held_at_once(func, out)
            if at_once:
                self.split.see(self.live - self.vocab, self.split_vocab + at_once)
            given = handed_on(func, args, out)
            if given is not None:  # the incoming gradient's bytes now live as long as ``out``
                self._split_bytes[id(out.untyped_storage())] = self._split_bytes.pop(
                    id(given.untyped_storage()), 0
                )
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                st = t.untyped_storage()
                if id(st) not in self._seen:
                    size = st.nbytes()
                    vocab = vocab_sized(t.shape, self.head_shape)
                    self._seen[id(st)] = weakref.ref(st, self._on_free(id(st), size, vocab))
                    self.live += size
                    self.vocab += size if vocab else 0
                    if vocab and id(st) not in self._split_bytes:
                        self._split_bytes[id(st)] = size
                        self.split_vocab += size
        self.peak = max(self.peak, self.live)
        self.frontier.see(self.live - self.vocab, self.vocab)
        self.split.see(self.live - self.vocab, self.split_vocab)
        return out

    def _on_free(self, key: int, size: int, vocab: bool) -> Callable[[Any], None]:
        """The weakref callback that counts storage ``key`` of ``size`` bytes freed."""
        return lambda _: self._freed(key, size, vocab)


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
    head, head_shape = _head(spec)
    live = _Live([*root.parameters(), *root.buffers(), *data], trained, head_shape)
    saved_after: Set[int] = set()  # storages the code after the layers saves for backward

    def pack(t: Tensor) -> Tensor:
        if live.phase == "after":
            saved_after.add(id(t.untyped_storage()))
        return t

    marks: Dict[str, int] = {}
    points: Dict[str, Points] = {}
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
            points["forward"] = live.frontier.above(0, 0)
            points["split_forward"] = live.split.above(0, 0)
            start = live.mark()
            base, split_base = live.restart()

            def backward_points() -> None:
                points["backward"] = live.frontier.above(*base)
                points["split_backward"] = live.split.above(*split_base)

            if head_input.requires_grad:
                head_input.register_hook(lambda g: marks.__setitem__("after", live.peak - start))
                head_input.register_hook(lambda g: backward_points())
                head_input.register_hook(lambda g: marks.__setitem__("left", live.live - start))
                head_input.register_hook(lambda g: marks.__setitem__("embeddings", live.mark()))
            carried.clear()
            del head_input
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
            after_backward = marks.get("after", live.peak - start)
            if "backward" not in points:  # no gradient reached the layers: the backward's end
                backward_points()
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
        head=head,
        head_shape=head_shape,
        forward_points=points["forward"],
        backward_points=points["backward"],
        split_forward_points=points["split_forward"],
        split_backward_points=points["split_backward"],
    )
