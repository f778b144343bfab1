"""Opt-in regional ``torch.compile`` (the ``compile`` setting): each pipelined layer alone.

Why per layer: a stage whose kernels are small is bound by the host's launches, and
fusing a layer's element-wise work cuts them; compiling per layer (as torchtitan does
per transformer block) keeps graphs small, lets identical layers share one graph, and
leaves the engine's own work (micro-batch split, stage boundaries, the checkpoint's
autograd Function) in eager mode, where it runs unchanged for every mode.

Why the layer's ``forward`` and not the module: compiling the bound ``forward`` into an
instance attribute keeps the module tree, so parameter names, ``state_dict`` keys and
checkpoints are the same as without compile (no ``_orig_mod.`` prefix), and a module
pipeline (``pipeline_of``) routes the compiled forward through its stage like any other.
The engine's teardown puts each layer's own forward back.

What stays exact: a recompute replays the RNG state of its forward, so under a backend
whose random ops draw from torch's generators (``aot_eager``, ``eager``), every checkpoint
mode gives bitwise the same gradients, dropout included (tested). Inductor generates its
own kernels: results match eager within floating-point tolerance, and its random ops
follow its own RNG scheme, so compare modes with dropout off there.
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
