"""Side inputs: ``self.layers(x, attention_mask=m)`` on a pipelined ``nn.Sequential``.

A Sequential hands each layer one value, the previous layer's output. A side input
(a keyword of the pipelined call) goes, cut into micro-batches like ``x``, to every
layer whose ``forward`` declares that keyword by name (or takes ``**kwargs``), in
every stage, and in every recompute. Which layer takes what is read once from the
signatures, so errors can name the user's call and the layer's own signature, in
the user's names (``layers.3``), before anything runs.
"""

import inspect
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from torch import nn

from pipeckpt._errors import config_error

__all__ = ["Chain", "Signatures", "describe_call"]

_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def describe_call(name: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
    """``layers(x, attention_mask=...)``: how the user's call looked, for messages."""
    parts = ["x"] if len(args) == 1 else [f"arg{i}" for i in range(len(args))]
    parts += [f"{k}=..." for k in kwargs]
    return f"{name}({', '.join(parts)})"


class _Layer:
    __slots__ = ("name", "names", "positional", "required", "signature", "var_keyword")

    def __init__(self, name: str, layer: nn.Module) -> None:
        self.name = name
        self.signature: Optional[inspect.Signature]
        try:
            self.signature = inspect.signature(layer.forward)
        except (TypeError, ValueError):  # a builtin forward: one input, nothing more known
            self.signature = None
        params = list(self.signature.parameters.values()) if self.signature is not None else []
        self.var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self.positional = any(
            p.kind
            in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.VAR_POSITIONAL,
            )
            for p in params[:1]
        )
        rest = params[1:] if self.positional else params
        self.names = frozenset(p.name for p in rest if p.kind in _KEYWORD_KINDS)
        self.required = [
            p.name
            for p in rest
            if p.default is inspect.Parameter.empty
            and p.kind in (*_KEYWORD_KINDS, inspect.Parameter.POSITIONAL_ONLY)
        ]

    def shown(self) -> str:
        return f"{self.name}: forward{self.signature if self.signature is not None else '(input)'}"


class Signatures:
    """The layers of a pipelined Sequential, by the user's name, and what each takes."""

    def __init__(self, name: str, layers: Sequence[Tuple[str, nn.Module]]) -> None:
        self.name = name
        self.layers = [_Layer(n, m) for n, m in layers]
        self._routes: Dict[FrozenSet[str], List[Tuple[str, ...]]] = {}

    def routes(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tuple[str, ...]]:
        """For each layer, the side inputs it takes; checks the call once per set of keywords."""
        keys = frozenset(kwargs)
        found = self._routes.get(keys)
        if found is None or len(args) != 1:
            found = self._routes[keys] = self._check(args, kwargs)
        return found

    def _check(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tuple[str, ...]]:
        call = describe_call(self.name, args, kwargs)
        first = self.layers[0]
        if len(args) != 1:
            raise config_error(
                f"{call} ({len(args)} positional arguments)",
                f"a pipelined Sequential passes one value from layer to layer; its first layer is "
                f"{first.shown()}",
                "pass one positional value (a tensor, or a tuple/dict of them, which reaches the first "
                "layer as one argument) and give everything else as keywords (side inputs) named as in "
                "the layers' forward",
            )
        routes = [tuple(k for k in kwargs if layer.var_keyword or k in layer.names) for layer in self.layers]
        unused = [k for k in kwargs if not any(k in r for r in routes)]
        if unused:
            raise config_error(
                f"side input {unused[0]}= of {call}",
                "no layer's forward declares it: "
                + "; ".join(sorted({lay.shown() for lay in self.layers})[:4]),
                f"name it as a layer's forward names it, or add `{unused[0]}=None` to the forward of "
                "the layers that use it",
            )
        for layer in self.layers:
            missing = [k for k in layer.required if k not in kwargs]
            if missing:
                raise config_error(
                    f"{call} without {missing[0]}=",
                    f"layer {layer.shown()} needs it",
                    f"pass it to the pipelined call: {self.name}(x, {missing[0]}=...)",
                )
        return routes


class Chain:
    """One stage's layers run in order, each given the side inputs it declares."""

    def __init__(self, layers: Sequence[nn.Module], routes: Sequence[Tuple[str, ...]]) -> None:
        self.steps = list(zip(layers, routes))

    def keys(self) -> FrozenSet[str]:
        return frozenset(k for _, r in self.steps for k in r)

    def __call__(self, x: Any, side: Dict[str, Any]) -> Any:
        # A route is a subset of ``side``'s keys, so one as long as ``side`` is all of them: such a
        # layer (the common case: every layer takes the mask) gets ``side`` without a copy.
        n = len(side)
        for layer, route in self.steps:
            if not route:
                x = layer(x)
            elif len(route) == n:
                x = layer(x, **side)
            else:
                x = layer(x, **{k: side[k] for k in route})
        return x
