"""Profiling a ``pipeline_of`` model from its own input: its layers replayed as a chain.

The profile (memory/profile.py) runs layers one after another, each on the one value the layer
before returned. A model with its own ``forward`` calls its layers with more than that (masks,
rotary embeddings) and runs code around them (embeddings before, the head and loss after), so its
first layer never sees the model's input. One forward of the model records every layer's call; each
layer then becomes a link of a chain that carries the value the model handed from layer to layer
and replays the rest of the call as recorded. The model's own code outside its layers is the
chain's last link (the model's ``forward`` again, every layer answering its recorded output). Why
not profile the model's ``forward`` itself: the passes time, cut and recompute layer by layer.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import tree_flatten, tree_unflatten
from pipeckpt._errors import config_error
from pipeckpt.boundaries.microbatch import scatter
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.boundaries.recorded import recorded_since, recorded_so_far, replay
from pipeckpt.boundaries.side_inputs import describe_call
from pipeckpt.checkpointing.kv_caches import without_kv_caches
from pipeckpt.memory.outside import OutsideMemory, outside_memory

__all__ = ["RootInput", "RootChain", "root_chain", "root_microbatch"]


@dataclass(frozen=True)
class RootInput:
    """The arguments of one call of a ``pipeline_of`` model's ``forward``: what the pipeline takes.

    Args:
        args: the positional arguments (the batch's tensors in the first).
        kwargs: the keyword arguments.
    """

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]

    @staticmethod
    def of(value: Any) -> "RootInput":
        """``value`` as Lightning passes ``example_input_array`` to ``forward``: a tuple as the
        positional arguments, a dict as the keywords, anything else as the one argument."""
        if isinstance(value, RootInput):
            return value
        if isinstance(value, tuple):
            return RootInput(value, {})
        if isinstance(value, dict):
            return RootInput((), dict(value))
        return RootInput((value,), {})


def root_microbatch(call: RootInput, chunks: int, name: str = "model") -> RootInput:
    """The first of the ``chunks`` micro-batches the pipeline cuts ``call`` into."""
    pieces = scatter(
        call.args, call.kwargs, chunks, call=describe_call(f"self.{name}", call.args, call.kwargs)
    )
    args, kwargs = pieces[0]
    return RootInput(tuple(args), dict(kwargs))


@dataclass
class _Call:
    """One recorded call of a layer: its arguments' leaves and its output's."""

    inputs: List[Any]
    spec: Any
    outputs: List[Any]
    output_spec: Any
    carried_in: int = -1  # the leaf of ``inputs`` the chain's value replaces
    carried_out: int = -1  # the leaf of ``outputs`` the chain passes on
    recorded: Dict[str, Tuple[Any, ...]] = field(default_factory=dict)  # HF's, inside it (router logits)


def _floating(leaves: Sequence[Any]) -> List[int]:
    return [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_floating_point()]


class _Link(nn.Module):
    """One layer called as the model called it, with the chain's value in place of the value the
    model passed it from the layer before."""

    def __init__(self, layer: nn.Module, call: _Call) -> None:
        super().__init__()
        self.layer = layer
        self.call = call

    def forward(self, h: Tensor) -> Tensor:
        leaves = list(self.call.inputs)
        leaves[self.call.carried_in] = h
        args, kwargs = tree_unflatten(leaves, self.call.spec)
        # As a pipelined stage calls it: without the KV cache the recorded call handed it, which
        # holds the recording's keys already (checkpointing/kv_caches.py).
        args, kwargs = without_kv_caches(self.layer.forward, tuple(args), dict(kwargs))
        out: Tensor = tree_flatten(self.layer(*args, **kwargs))[0][self.call.carried_out]
        return out


class _Outside(nn.Module):
    """The model's own code outside its layers (embeddings, head, loss), on the chain's value: its
    ``forward`` with every layer answering its recorded output, the last layer the chain's value.
    The parameters it counts are the model's outside its layers (each tied one once)."""

    spec: ModulePipeline

    def __init__(self, spec: ModulePipeline, call: RootInput, calls: List[_Call]) -> None:
        super().__init__()
        self.__dict__["spec"] = spec  # not children: their parameters are the layers' own
        self.call, self.calls = call, calls

    def own_parameters(self) -> List[nn.Parameter]:
        inside = {id(p) for p in self.spec.parameters()}
        return [p for p in self.spec.root.parameters() if id(p) not in inside]

    def forward(self, h: Tensor) -> Tuple[Tensor, ...]:
        last = len(self.calls) - 1
        answers = []
        for i, call in enumerate(self.calls):
            leaves = list(call.outputs)
            if i == last:
                leaves[call.carried_out] = h
            answers.append(tree_unflatten(leaves, call.output_spec))
        with _answering(list(self.spec), answers, self.calls):
            out = self.spec.root(*self.call.args, **self.call.kwargs)
        return tuple(t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad)


@contextmanager
def _answering(layers: List[nn.Module], answers: List[Any], calls: List[_Call]) -> Iterator[None]:
    def answering(answer: Any, call: _Call) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            replay(call.recorded)  # what its insides recorded (the load-balancing loss reads it)
            return answer

        return forward

    for layer, answer, call in zip(layers, answers, calls):
        layer.forward = answering(answer, call)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


@dataclass(frozen=True)
class RootChain:
    """What the profile runs for a ``pipeline_of`` model: the layers as links, the chain's first
    value (the first layer's input as the model made it), and the code outside the layers."""

    links: List[nn.Module]
    first: Tensor
    outside: nn.Module


def _record(spec: ModulePipeline, call: RootInput) -> List[_Call]:
    """Every named layer's call in one forward of the model (no gradient), in order."""
    layers = list(spec)
    position = {id(layer): i for i, layer in enumerate(layers)}
    seen: List[Tuple[int, _Call]] = []
    so_far: Dict[str, int] = {}

    def enter(module: nn.Module, args: Any) -> None:
        so_far.update(recorded_so_far())

    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        inputs, in_spec = tree_flatten((args, kwargs))
        outputs, out_spec = tree_flatten(output)
        call = _Call(inputs, in_spec, outputs, out_spec, recorded=recorded_since(so_far))
        seen.append((position[id(module)], call))

    handles = [layer.register_forward_pre_hook(enter) for layer in layers]
    handles += [layer.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            spec.root(*call.args, **call.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    order = [i for i, _ in seen]
    if order != list(range(len(layers))):
        raise config_error(
            f"checkpoint='auto' on pipeline_of({type(spec.root).__name__}, ...)",
            f"profiling needs every named layer called once per forward, in order (called: {order} of "
            f"{len(layers)} layers)",
            "name in pipeline_of(...) only layers that forward calls once each, in the order it calls them",
        )
    return [c for _, c in seen]


def _link(calls: List[_Call], root: str) -> None:
    """Which leaf each call takes from the call before it (the same tensor, else the first
    floating one of the same shape), and which leaf it passes on."""
    for i, call in enumerate(calls):
        floats = _floating(call.inputs)
        if not floats:
            raise config_error(
                f"checkpoint='auto' on pipeline_of({root}, ...)",
                f"profiling carries a floating-point tensor from layer to layer; layer {i} takes none",
                "profile the model with pipeckpt.plan's memory model by hand, or choose checkpoint modes",
            )
        call.carried_in = floats[0]
        if i == 0:
            continue
        before = calls[i - 1]
        same = [
            (k, j)
            for k in floats
            for j in _floating(before.outputs)
            if call.inputs[k] is before.outputs[j]
            or (
                call.inputs[k].shape == before.outputs[j].shape
                and call.inputs[k].dtype == before.outputs[j].dtype
            )
        ]
        identical = [(k, j) for k, j in same if call.inputs[k] is before.outputs[j]]
        if not same:
            raise config_error(
                f"checkpoint='auto' on pipeline_of({root}, ...)",
                f"profiling carries a tensor from layer to layer; layer {i} takes none shaped as "
                f"an output of layer {i - 1}",
                "choose checkpoint modes by hand for this model",
            )
        call.carried_in, before.carried_out = (identical or same)[0]
    last = calls[-1]
    last.carried_out = (_floating(last.outputs) or [0])[0]


def root_chain(spec: ModulePipeline, call: RootInput) -> RootChain:
    """The chain the profile runs for ``spec`` on ``call`` (one micro-batch of the model's input)."""
    calls = _record(spec, call)
    _link(calls, type(spec.root).__name__)
    first = calls[0].inputs[calls[0].carried_in].detach().requires_grad_()
    links: List[nn.Module] = [_Link(layer, c) for layer, c in zip(spec, calls)]
    return RootChain(links=links, first=first, outside=_Outside(spec, call, calls))


def outside_parameters(module: nn.Module) -> Optional[List[nn.Parameter]]:
    """The parameters of the model outside its layers, for the chain's last link (None for others)."""
    return module.own_parameters() if isinstance(module, _Outside) else None


def measure_outside(module: nn.Module) -> Optional[OutsideMemory]:
    """The chain's last link's code, measured as it runs per micro-batch (memory/outside.py); None
    for a module that is not one."""
    if not isinstance(module, _Outside):
        return None
    return outside_memory(module.spec, module.call, module.calls)
