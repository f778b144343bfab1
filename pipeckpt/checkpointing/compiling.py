"""Opt-in regional ``torch.compile`` (the ``compile`` setting): each pipelined layer alone.

Why not ``torch.compile`` on the whole model: per layer (as torchtitan compiles per block) graphs stay
small, identical layers share one, and the engine's own work (micro-batch split, stage boundaries,
the checkpoint's autograd Function) stays eager. Why the layer's ``forward`` and not the module: the
module tree, parameter names and ``state_dict`` keys stay as without compile (no ``_orig_mod.``
prefix). What stays exact under each backend: docs/DESIGN.md, checkpointing/compiling.
"""

import weakref
from typing import Any, Dict, Optional

import torch
from torch import nn

from pipeckpt._errors import config_error

__all__ = ["MODES", "BACKENDS", "check_compile", "compile_options", "compile_layers", "uncompile_layers"]

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
BACKENDS = ("aot_eager", "eager")  # need no C++/CUDA compiler: capture checks, exactness tests

# layer -> the compiled forward set on it and the instance forward it replaced (None: the class's)
_COMPILED: "weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any]]" = weakref.WeakKeyDictionary()


def check_compile(value: Any) -> None:
    if isinstance(value, bool) or value in MODES or value in BACKENDS:
        return
    raise config_error(
        f"compile={value!r}",
        f"must be False, True, an inductor mode {MODES} or a backend {BACKENDS}",
        "set compile=True (inductor, needs a C++ compiler on CPU) or compile='aot_eager'",
    )


def compile_options(value: Any) -> Optional[Dict[str, Any]]:
    """The keyword arguments of ``torch.compile`` for a ``compile`` setting; None when off."""
    check_compile(value)
    if value is False:
        return None
    if value is True:
        return {}
    if value in BACKENDS:
        return {"backend": value}
    return {"mode": value}


def compile_layers(layers: nn.Sequential, value: Any) -> None:
    """Compiles each layer's forward in place, per the ``compile`` setting (False: nothing)."""
    options = compile_options(value)
    if options is None:
        return
    for layer in layers:
        if layer in _COMPILED:
            continue
        own = layer.__dict__.get("forward")
        compiled = torch.compile(layer.forward, **options)
        layer.__dict__["forward"] = compiled
        _COMPILED[layer] = (compiled, own)


def uncompile_layers(layers: nn.Sequential) -> None:
    """Each layer compiled by :func:`compile_layers` gets back the forward it had."""
    for layer in layers:
        entry = _COMPILED.pop(layer, None)
        if entry is None:
            continue
        compiled, own = entry
        if layer.__dict__.get("forward") is not compiled:
            continue  # someone (a module pipeline's restore) already took it off
        if own is None:
            del layer.__dict__["forward"]
        else:
            layer.__dict__["forward"] = own
