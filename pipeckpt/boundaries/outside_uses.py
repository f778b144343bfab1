"""Which stages of a ``pipeline_of`` model read each of its parameters outside the named layers.

Under the distributed engine every stage replays the model's own ``forward`` (engines/distributed/
rooted.py), yet a stage needs only the outside parameters whose values reach what it computes: the
input embedding on the first stage, the final norm and LM head on the last, a tied weight on both.
Why a probe and not module names per family: what a model computes outside its layers, and in which
order, is its own code (Gemma scales its embedding, T5 normalises the encoder's output before the
decoder's layers read it, BART ties four names to one weight). So ``forward`` runs once on fake
tensors (nothing is allocated or computed), each layer's output cut from the graph there as a later
stage's received copy of it is. A parameter is read by the stage of layer ``i`` when the graph of
layer ``i``'s output reaches it, and by the last stage when the graph of the model's output does.
Every outside parameter takes a gradient in the probe, so a frozen one (LoRA's base) is found too.

The same graphs tell which layer outputs a later stage reads (:class:`Handoffs`): each cut
output's floating tensors are leaves that take a gradient, and layer ``i`` reads the outputs whose
leaves the graph of its output reaches (its input, the layer before's; a decoder's cross-attention
input, the encoder's last; the router logits the model's loss adds up). The engine sends a later
stage only those (engines/distributed/handoffs.py), not every output so far.

A parameter that code outside its own module's call reads (``self.embed.weight[ids]`` in the root's
``forward``, a layer that reads another module's weight) is marked ``everywhere``: its module cannot
stand in for it where it is not held (engines/distributed/outside_parts.py), so every stage keeps it.
"""

import logging
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Container, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from pipeckpt._compat import FakeTensorMode, own_tensors, set_own_tensor, tree_flatten, tree_map
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.boundaries.recorded import recording

__all__ = ["Handoffs", "OutsideUses", "holds", "outside_uses"]

Leaf = Tuple[int, int]  # (layer index, position among the tensor leaves of that layer's output)


@dataclass(frozen=True)
class Handoffs:
    """Which layer outputs a ``pipeline_of`` model's layers and output read, leaf by leaf.

    Args:
        reads: per layer, the leaves of earlier layers' outputs its call's output depends on.
        output: the leaves of layer outputs the model's output depends on.
        opaque: the leaves no gradient can follow (integer tensors): read by every later stage.
        counts: per layer, the tensor leaves of its output (a call returning others is sent whole).
        sizes: per layer, the bytes of each tensor leaf of its output.
    """

    reads: Tuple[FrozenSet[Leaf], ...]
    output: FrozenSet[Leaf]
    opaque: FrozenSet[Leaf] = frozenset()
    counts: Tuple[int, ...] = ()
    sizes: Tuple[Tuple[int, ...], ...] = ()

    def crossing(self, boundary: int) -> FrozenSet[Leaf]:
        """The leaves that cross from the stage ending before layer ``boundary`` to the next: those
        of the layers before it that a layer from ``boundary`` on, the model's output or no gradient
        reads (a stage sends what any later stage reads, so only the boundary decides). The one
        rule of the engine and the memory model."""
        later = set(self.output) | set(self.opaque)
        later.update(*self.reads[boundary:])
        return frozenset(leaf for leaf in later if leaf[0] < boundary)

    def sent(self, ranges: Sequence[Tuple[int, int]]) -> Tuple[FrozenSet[Leaf], ...]:
        """Per stage of ``ranges`` (layer index ranges), the leaves it sends the next (none from the last)."""
        last = len(ranges) - 1
        return tuple(frozenset() if j == last else self.crossing(b) for j, (_, b) in enumerate(ranges))

    def bytes_crossing(self, boundary: int) -> int:
        """The bytes of :meth:`crossing` for the probe's call (one micro-batch, as the profile probes it)."""
        return sum(self.sizes[k][n] for k, n in self.crossing(boundary))


@dataclass(frozen=True)
class OutsideUses:
    """What a ``pipeline_of`` model's layers and output read outside the layers, by parameter name.

    Args:
        layers: per layer (in ``pipeline_of`` order), the outside parameters its call's output
            depends on other than through another layer's output.
        output: the outside parameters the model's output depends on other than through a layer's.
        everywhere: the outside parameters read outside their own module's call.
        handoffs: which layer outputs each layer and the output read (None: not probed, every
            output read everywhere).
    """

    layers: Tuple[FrozenSet[str], ...]
    output: FrozenSet[str]
    everywhere: FrozenSet[str]
    handoffs: Optional["Handoffs"] = None

    def stages(self, ranges: Sequence[Tuple[int, int]], names: Iterable[str]) -> Dict[str, Tuple[int, ...]]:
        """For each parameter of ``names``, the stages (of ``ranges``, layer index ranges) that hold it."""
        last = len(ranges) - 1
        out: Dict[str, Tuple[int, ...]] = {}
        for name in names:
            readers = {i for i, used in enumerate(self.layers) if name in used}
            read = (readers, name in self.output, name in self.everywhere)
            out[name] = tuple(j for j, (a, b) in enumerate(ranges) if holds(*read, a, b, j == last))
        return out


def holds(readers: Container[int], output: bool, everywhere: bool, start: int, stop: int, last: bool) -> bool:
    """Whether the stage of layers ``[start, stop)`` (the last stage when ``last``) holds a parameter
    that the layers ``readers`` read (and the model's output when ``output``; everything, read outside
    its module's call, when ``everywhere``): the one rule of the engine and the memory model."""
    return everywhere or (last and output) or any(i in readers for i in range(start, stop))


_DATA_READS = frozenset(
    {Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__}
)


class _Reads(TorchFunctionMode):
    """Marks the outside parameters an op reads while their own module's call is not running, and
    the layer outputs read where no gradient follows (a mask compared from them, ``.item()``): by
    the layer whose call runs (None: by the model's own code, so by every later stage)."""

    def __init__(self, owner: Dict[int, Tuple[str, Tuple[nn.Module, ...]]]) -> None:
        super().__init__()
        self.owner = owner
        self.running: List[nn.Module] = []
        self.outside: Set[str] = set()
        self.cut: Dict[int, Leaf] = {}  # id of a cut layer output's tensor -> its leaf
        self.layer: List[int] = []  # the layers whose calls run, innermost last
        self.unseen: Dict[Optional[int], Set[Leaf]] = {}

    def enter(self, module: nn.Module, _args: Any) -> None:
        self.running.append(module)

    def leave(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        self.running.pop()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        data = func in _DATA_READS
        if made or data:  # metadata (.dtype, .shape) is no read
            ungraded = data or not any(t.requires_grad for t in made)
            for t in tree_flatten((args, kwargs or {}))[0]:
                if not isinstance(t, Tensor):
                    continue
                found = self.owner.get(id(t))
                if made and found is not None and not any(m is h for m in self.running for h in found[1]):
                    self.outside.add(found[0])
                leaf = self.cut.get(id(t))
                if leaf is not None and ungraded:
                    self.unseen.setdefault(self.layer[-1] if self.layer else None, set()).add(leaf)
        return out


def _reached(tensors: Iterable[Any], names: Dict[int, Any]) -> FrozenSet[Any]:
    """The keys in ``names`` (by the id of a leaf tensor) that the autograd graphs of ``tensors`` reach."""
    tensors = [t for t in tensors if isinstance(t, Tensor)]
    found: Set[Any] = {names[id(t)] for t in tensors if id(t) in names}  # handed on unchanged
    seen: Set[int] = set()
    todo: List[Any] = [t.grad_fn for t in tensors if isinstance(t, Tensor) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in names:
            found.add(names[id(variable)])
        todo.extend(n for n, _ in node.next_functions)
    return frozenset(found)


def _cut(value: Any) -> Any:
    """``value`` with each tensor a new leaf, as a later stage receives a layer's output; a floating
    one takes a gradient, so that the graphs of what reads it reach it."""

    def leaf(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        return t.detach().requires_grad_(t.is_floating_point())

    return tree_map(leaf, value)


def outside_uses(
    spec: ModulePipeline,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    device: torch.device,
    *,
    fake: bool = True,
) -> OutsideUses:
    """:class:`OutsideUses` of ``spec``'s model called with ``args`` and ``kwargs`` (one call as the
    user's step makes it), leaving the model as it was; raises what the model's ``forward`` raises.
    ``fake``: on fake tensors (the model's meta tensors on ``device``); else on its real tensors, in
    eval mode (no BatchNorm statistics move), for a model whose code reads values (a mask compared
    with a causal one), which fake tensors do not hold."""
    root = spec.root
    inside = {id(p) for p in spec.parameters()}
    names = {id(p): n for n, p in root.named_parameters() if id(p) not in inside}
    outputs: List[Any] = [None] * len(spec)
    cuts: List[Any] = [None] * len(spec)
    with ExitStack() as stack:
        stack.callback(_restore_attributes, root, _attributes(root))  # a value the model caches on a call
        if fake:
            stack.enter_context(_quiet(logging.getLogger("torch._subclasses.fake_tensor")))
            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            _fake_tensors(root, names, device, stack)
            args, kwargs = tree_map(
                lambda t: mode.from_tensor(t) if isinstance(t, Tensor) else t, (args, kwargs)
            )
        else:
            _real_tensors(root, names, stack)
        holders: Dict[int, List[nn.Module]] = {}  # a tied weight: every module that holds it
        for module in root.modules():
            for _, t, is_param in own_tensors(module):
                if is_param and id(t) in names:
                    holders.setdefault(id(t), []).append(module)
        reads = _Reads({i: (names[i], tuple(ms)) for i, ms in holders.items()})
        for module in {id(m): m for ms in holders.values() for m in ms}.values():
            stack.enter_context(module.register_forward_pre_hook(reads.enter))
            stack.enter_context(module.register_forward_hook(reads.leave))
        for index, layer in enumerate(spec):
            layer.forward = _probe_layer(index, layer.forward, outputs, cuts, reads)
            stack.callback(layer.__dict__.pop, "forward", None)
        with torch.enable_grad(), reads:
            out = root(*args, **kwargs)
        leaves = [[t for t in tree_flatten(c)[0] if isinstance(t, Tensor)] for c in cuts]
        cut_ids: Dict[int, Any] = {id(t): (i, n) for i, ts in enumerate(leaves) for n, t in enumerate(ts)}
        keys: Dict[int, Any] = {**names, **cut_ids}
        found = [_reached(tree_flatten(o)[0], keys) if o is not None else frozenset() for o in outputs]
        at_output = _reached(tree_flatten(out)[0], keys)
        opaque = frozenset(cut_ids[id(t)] for ts in leaves for t in ts if not t.is_floating_point())
        opaque |= reads.unseen.get(None, set())
        handoffs = Handoffs(
            tuple(
                frozenset(k for k in f if isinstance(k, tuple)) | reads.unseen.get(i, set())
                for i, f in enumerate(found)
            ),
            frozenset(k for k in at_output if isinstance(k, tuple)),
            opaque,
            tuple(len(ts) for ts in leaves),
            tuple(tuple(t.numel() * t.element_size() for t in ts) for ts in leaves),
        )
        return OutsideUses(
            tuple(frozenset(k for k in f if isinstance(k, str)) for f in found),
            frozenset(k for k in at_output if isinstance(k, str)),
            frozenset(reads.outside),
            handoffs,
        )


def _fake_tensors(root: nn.Module, names: Dict[int, str], device: torch.device, stack: ExitStack) -> None:
    """Every tensor of ``root`` swapped for a fake one (tied ones stay tied; the outside parameters
    ``names``, re-keyed to their fakes, take a gradient) until ``stack`` closes."""
    made: Dict[int, Tensor] = {}
    swapped: List[Tuple[nn.Module, str, Tensor, bool]] = []
    stack.callback(_restore, swapped)
    for owner in root.modules():
        for name, t, is_param in own_tensors(owner):
            if id(t) not in made:
                fake = torch.empty_like(t, device=device if t.is_meta else t.device)
                grad = id(t) in names or (is_param and t.requires_grad)
                made[id(t)] = nn.Parameter(fake, grad and fake.is_floating_point()) if is_param else fake
                if id(t) in names:
                    names[id(made[id(t)])] = names.pop(id(t))
            swapped.append((owner, name, t, is_param))
            set_own_tensor(owner, name, made[id(t)], is_param)


def _real_tensors(root: nn.Module, names: Dict[int, str], stack: ExitStack) -> None:
    """``root`` in eval mode, its outside parameters ``names`` taking a gradient, until ``stack`` closes."""
    modes = [(m, m.training) for m in root.modules()]
    params = [p for p in root.parameters() if id(p) in names and p.is_floating_point()]
    flags = [(p, p.requires_grad) for p in params]
    stack.callback(lambda: [m.train(t) for m, t in modes] and None)
    stack.callback(lambda: [p.requires_grad_(g) for p, g in flags] and None)
    root.eval()
    for p in params:
        p.requires_grad_(True)


def _probe_layer(index: int, own: Any, outputs: List[Any], cuts: List[Any], reads: _Reads) -> Any:
    def probed(*args: Any, **kwargs: Any) -> Any:
        found = recording()
        fn = own if found is None else found.carried(own)
        reads.layer.append(index)
        try:
            out = fn(*args, **kwargs)
            cut = _cut(out)  # a received output handed on unchanged is the layer's read
        finally:
            reads.layer.pop()
        outputs[index] = out if outputs[index] is None else (outputs[index], out)
        if cuts[index] is None:
            cuts[index] = cut
            tensors = [t for t in tree_flatten(cut)[0] if isinstance(t, Tensor)]
            reads.cut.update({id(t): (index, n) for n, t in enumerate(tensors)})
        if found is None:
            return cut
        value, recorded = cut
        found.add(recorded)
        return value

    return probed


_SLOTS = ("_parameters", "_buffers", "_modules")


@contextmanager
def _quiet(log: logging.Logger) -> Iterator[None]:
    """``log`` silent within: fake tensors log an op they cannot run as an error before raising it,
    and a probe that then runs on real tensors has nothing to report."""
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _attributes(root: nn.Module) -> List[Tuple[nn.Module, Dict[str, Any]]]:
    """Each module's own attributes (a shallow copy): the demo Transformer keeps its causal mask and
    position table, made on its first call, as plain attributes, which must not stay fake."""
    return [(m, {k: v for k, v in m.__dict__.items() if k not in _SLOTS}) for m in root.modules()]


def _restore_attributes(root: nn.Module, saved: List[Tuple[nn.Module, Dict[str, Any]]]) -> None:
    """The tensors a call left in modules' attributes taken back; anything else it set stays, as a
    first call sets it (transformers marks a model whose output-capturing hooks it installed: undoing
    the mark alone would install them twice, and record every router's logits twice)."""
    for module, attributes in saved:
        for key, value in list(module.__dict__.items()):
            if key in _SLOTS or not isinstance(value, Tensor):
                continue
            if key not in attributes:
                del module.__dict__[key]
            elif attributes[key] is not value:
                module.__dict__[key] = attributes[key]


def _restore(swapped: Sequence[Tuple[nn.Module, str, Tensor, bool]]) -> None:
    for owner, name, t, is_param in reversed(swapped):
        set_own_tensor(owner, name, t, is_param)
