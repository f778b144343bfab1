"""The memory pass of :mod:`pipeckpt.memory.profile`: one micro-batch forward and backward, layer by
layer, naming every storage each layer takes, returns and saves (and what selective
checkpointing's policy would keep), and each layer's forward and backward peaks under torch's
``MemTracker``. Apart from the profile because the passes are one job: the profile only runs them
and reads the records they return.
"""

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from pipeckpt._compat import (
    MemTracker,
    TorchDispatchMode,
    module_memory,
    sac_saved_ops,
    tree_flatten,
    tree_unflatten,
)
from pipeckpt.memory.made_bytes import MadeBytes
from pipeckpt.memory.rooted import outside_parameters
from pipeckpt.stages.weight_pass import WeightPass, input_pass

__all__: List[str] = []


class Storages:
    """Names every storage it is shown with a small integer, remembering its size and the shape of
    the first tensor it was shown in."""

    def __init__(self, exclude: Sequence[Tensor]) -> None:
        self._ids: Dict[int, int] = {}
        self._keep: List[Any] = []  # the storages, alive for as long as the profile runs
        self.bytes: Dict[int, int] = {}
        self.shapes: Dict[int, Tuple[int, ...]] = {}
        self._excluded = {id(t.untyped_storage()) for t in exclude}
        self._keep.extend(t.untyped_storage() for t in exclude)

    def ids(self, value: Any) -> Tuple[int, ...]:
        out = []
        for t in tree_flatten(value)[0]:
            if not isinstance(t, Tensor):
                continue
            st = t.untyped_storage()
            if id(st) in self._excluded:
                continue
            if id(st) not in self._ids:
                self._ids[id(st)] = len(self._ids)
                self._keep.append(st)
                self.bytes[self._ids[id(st)]] = st.nbytes()
                self.shapes[self._ids[id(st)]] = tuple(int(d) for d in t.shape)
            out.append(self._ids[id(st)])
        return tuple(dict.fromkeys(out))


class _LayerRecorder(nn.Module):
    """The layers (and loss) under one root, so that MemTracker names each by its own path
    (``layers.3``) even where several layers share a class; ``forward`` notes what each layer
    takes, returns and saves."""

    def __init__(self, layers: List[nn.Module], loss: Optional[nn.Module], storages: Storages) -> None:
        super().__init__()
        self.layers = nn.ModuleList([*layers, *([loss] if loss is not None else [])])
        self.storages = storages
        self.records: List[Dict[str, Any]] = []

    def pack(self, t: Tensor) -> Tensor:
        if self.records and "outputs" not in self.records[-1]:
            self.records[-1]["saved"].update(self.storages.ids(t))
        return t

    def forward(self, x: Any) -> Any:
        h = x
        for layer in self.layers:
            record: Dict[str, Any] = {"inputs": self.storages.ids(h), "saved": set(), "sac": set()}
            self.records.append(record)
            h = layer(h)
            record["outputs"] = self.storages.ids(h)
        return h


class _SacOutputs(TorchDispatchMode):
    """Notes, for the layer the probe is running, the storages of the outputs of the ops that
    selective checkpointing's policy keeps, and times every op (the ops SAC keeps apart)."""

    def __init__(self, probe: _LayerRecorder) -> None:
        super().__init__()
        self.probe = probe
        self.saved_ops = frozenset(sac_saved_ops())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        took = time.perf_counter() - t0
        records = self.probe.records
        if records and "outputs" not in records[-1]:
            record = records[-1]
            kept = getattr(func, "overloadpacket", func) in self.saved_ops
            record["op_s"] = record.get("op_s", 0.0) + took
            record["ops"] = record.get("ops", 0) + 1
            if kept:
                record["sac"].update(self.probe.storages.ids(out))
                record["sac_op_s"] = record.get("sac_op_s", 0.0) + took
        return out


def memory_pass(
    layers: List[nn.Module], x: Any, loss: Optional[nn.Module], storages: Storages, *, split: bool = True
) -> Tuple[List[Dict[str, Any]], Tuple[int, ...]]:
    """Two forward and backward passes: one with a saved-tensor hook naming every storage each
    layer saves (and a dispatch mode naming what selective checkpointing would keep), one under
    MemTracker for each layer's peaks (apart: a hook that keeps the saved tensor changes when
    autograd frees it); then, with ``split``, each layer's split backward (:func:`_split_held`)."""
    batch_inputs = storages.ids(x)
    probe = _LayerRecorder(layers, loss, storages)
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, _unpack), _SacOutputs(probe):
        _forward_backward(probe, x)
    records, probe.records = probe.records, []
    tracker = _tracker(loss)
    with tracker:
        _forward_backward(probe, x)
    for module, record in zip(probe.layers, records):
        snap = module_memory(tracker, module)
        record["forward_peak"] = snap.get("Peak-Forward", 0) - snap.get("Pre-Forward", 0)
        record["backward_peak"] = snap.get("Peak-Backward", 0) - snap.get("Pre-Backward", 0)
    for record, held_peak in zip(records, _held_backward_peaks(probe, x)):
        record["backward_held_peak"] = held_peak
    # A first micro-batch's backward makes each weight gradient anew and keeps it (later ones add
    # theirs into ``.grad`` in place, a temporary at a time, as the passes above measured).
    for p in probe.parameters():
        p.grad = None
    for record, held_peak in zip(records, _held_backward_peaks(probe, x)):
        record["first_backward_peak"] = held_peak
    for record, (held, whole, weight_peak) in zip(records, _split_held(layers, x) if split else []):
        record["split_held"], record["split_whole"], record["weight_pass_peak"] = held, whole, weight_peak
    return records, batch_inputs


def _split_held(layers: List[nn.Module], x: Any) -> List[Tuple[int, bool, Optional[int]]]:
    """Per layer, on the engine's own split (stages/weight_pass.py ``input_pass``), each layer alone on
    its input made a leaf (a stage's recorded gradients are its layers'): the bytes its input pass
    keeps for its weight pass, the gradients recorded where its weights join its input's path (every
    linear's output, a norm's); whether nothing of its input needs a gradient (a stage it begins
    defers its whole backward to the weight pass); and the most its weight pass allocates at once
    (None: it has none), measured on a second micro-batch, whose weight gradients add into ``.grad``
    as every one after a step's first does."""
    out: List[Tuple[int, bool, Optional[int]]] = []
    h = x
    for layer in layers:
        weight_pass, wrt, made = _input_pass(layer, h)
        if weight_pass is not None:
            weight_pass()  # the first micro-batch's: makes each ``.grad``
            with MadeBytes() as live:  # from the forward: the frees of what it saved are seen
                weight_pass, wrt, made = _input_pass(layer, h)
                assert weight_pass is not None
                held = {id(g.untyped_storage()): g.untyped_storage().nbytes() for g in weight_pass.held()}
                start = live.mark()
                weight_pass()
                out.append((sum(held.values()), not wrt, live.peak - start))
        else:
            out.append((0, not wrt, None))
        h = made
    return out


def _input_pass(layer: nn.Module, h: Any) -> Tuple[Optional[WeightPass], List[Tensor], Any]:
    """``layer`` run on ``h`` made leaves and its split backward's input pass from gradients of ones:
    the weight pass it leaves (None: nothing to split), the inputs it differentiated, and the
    layer's output."""
    flat, spec = tree_flatten(h)
    leaves = [t.detach().requires_grad_() if isinstance(t, Tensor) and t.requires_grad else t for t in flat]
    wrt = [t for t, was in zip(leaves, flat) if isinstance(was, Tensor) and was.requires_grad]
    made = layer(tree_unflatten(leaves, spec))
    outputs = [t for t in tree_flatten(made)[0] if isinstance(t, Tensor) and t.requires_grad]
    own = outside_parameters(layer)
    params = [p for p in (layer.parameters() if own is None else own) if p.requires_grad]
    if not (outputs and params):
        return None, wrt, made
    edges = [get_gradient_edge(t) for t in outputs]
    return input_pass(edges, [torch.ones_like(t) for t in outputs], wrt, params), wrt, made


def _held_backward_peaks(probe: _LayerRecorder, x: Any) -> List[int]:
    """Each layer's backward peak above what was live before it, with the gradient that arrived
    for its output held through its backward. Plain autograd frees that gradient once the layer's
    first node has used it; the stage's Function (stages/recompute.py ``_Recompute``) holds it through
    the whole backward run inside it, and a layer ending a segment runs there. Every such gradient is
    held until the pass ends: one freed during a later layer's backward would lower that layer's
    peak below what was live before it. Measured, not added: where a layer's peak comes before its
    first node is done, holding the gradient changes nothing."""
    held: List[Tensor] = []
    handles = [m.register_forward_hook(_hold_output_gradient(held.append)) for m in probe.layers]
    tracker = _tracker(probe.layers[-1])
    try:
        with tracker:
            _forward_backward(probe, x)
    finally:
        for handle in handles:
            handle.remove()
        held.clear()
    out = []
    for module in probe.layers:
        snap = module_memory(tracker, module)
        out.append(snap.get("Peak-Backward", 0) - snap.get("Pre-Backward", 0))
    return out


def _tracker(last: Optional[nn.Module]) -> Any:
    """A MemTracker that knows, beside the probe's own modules, the parameters (and gradients) of a
    ``pipeline_of`` model outside its layers, which the chain's last link uses without holding them
    as children (memory/rooted.py): untracked, MemTracker would count them made in its forward."""
    tracker = MemTracker()
    own = outside_parameters(last) if last is not None else None
    if own:
        tracker.track_external(nn.ParameterList(own))
    return tracker


def _hold_output_gradient(hold: Callable[[Tensor], None]) -> Callable[..., None]:
    def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
        for t in tree_flatten(output)[0]:
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(hold)

    return hook


def _forward_backward(module: nn.Module, x: Any) -> None:
    h = module(x)
    outputs = [t for t in tree_flatten(h)[0] if isinstance(t, Tensor) and t.requires_grad]
    del h
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def _unpack(t: Tensor) -> Tensor:
    return t
