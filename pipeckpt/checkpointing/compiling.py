"""Opt-in regional ``torch.compile`` (the ``compile`` setting): each pipelined layer alone.

Why not ``torch.compile`` on the whole model: per layer (as torchtitan compiles per block) graphs stay
small, identical layers share one, and the engine's own work (micro-batch split, stage boundaries,
the checkpoint's autograd Function) stays eager. Why the layer's ``forward`` and not the module: the
module tree, parameter names and ``state_dict`` keys stay as without compile (no ``_orig_mod.``
prefix). What stays exact under each backend: docs/DESIGN.md, checkpointing/compiling.

A layer of a ``selective`` stage is compiled with its checkpoint inside: ``torch.utils.checkpoint``
with SAC's policy (:mod:`pipeckpt.checkpointing.selective`) traced into the layer's graph, where
the policy decides once, at graph partitioning, what the backward recomputes. Eager SAC around a
compiled layer instead runs a Python dispatch mode over every op of every step (4.7-10x plain
in bf16 on an H200, benchmarks/RESULTS.md "GPU").

Under a CUDA-graph mode (:data:`CUDA_GRAPH_MODES`) a CUDA-graph tree replays a graph over the memory
of its last replay's outputs once it counts a new step begun, which every call that leaves no backward
pending starts: a forward without gradients, and a recompute, whose backward runs at once. So:
- each graphed layer's outputs are cloned out of the graph's pool (torch's own remedy, named in its
  error), since the pipeline holds a micro-batch's output for the next stage meanwhile;
- the layers of a stage that recomputes (``except_last``, ``always``, ``:k``) compile without CUDA
  graphs (``reduce-overhead`` as the default mode, ``max-autotune`` as ``max-autotune-no-cudagraphs``):
  each micro-batch's recompute would start a new step in the middle of the pipeline's backward, over
  the gradients the last one left in ``.grad`` (on an H200, torch 2.11: "accessing tensor output of
  CUDAGraphs that has been overwritten by a subsequent run" in backward, benchmarks/RESULTS.md "GPU").
A ``never`` or ``selective`` stage (SAC inside the graph) keeps every backward pending until the
pipeline's, and replays its graphs.
"""

import functools
import weakref
from typing import Any, Callable, Collection, ContextManager, Dict, FrozenSet, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from pipeckpt._compat import tree_flatten, tree_unflatten
from pipeckpt._errors import config_error
from pipeckpt.checkpointing.modes import CheckpointMode
from pipeckpt.checkpointing.selective import selective_region

__all__ = [
    "MODES",
    "BACKENDS",
    "check_compile",
    "compile_options",
    "compile_layers",
    "uncompile_layers",
    "uncompiled",
    "selective_in_graph",
    "selective_layers",
    "recomputed_layers",
]

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
BACKENDS = ("aot_eager", "eager")  # need no C++/CUDA compiler: capture checks, exactness tests
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # inductor modes that replay CUDA graphs
# torch.compile's options for a CUDA-graph mode's layer that must not replay graphs (module doc)
_WITHOUT_GRAPHS: Dict[str, Dict[str, Any]] = {
    "reduce-overhead": {},
    "max-autotune": {"mode": "max-autotune-no-cudagraphs"},
}

# layer -> the compiled forward set on it and the instance forward it replaced (None: the class's)
_COMPILED: "weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any]]" = weakref.WeakKeyDictionary()
# the layers whose compiled forward holds SAC's checkpoint (a selective stage's)
_SELECTIVE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def check_compile(value: Any, modes: Union[str, Sequence[CheckpointMode]] = ()) -> None:
    """Refuses a ``compile`` setting torch.compile does not take, and a CUDA-graph mode
    (:data:`CUDA_GRAPH_MODES`) with an offloading checkpoint mode (``modes``: the stages', or
    ``"auto"``, which may pick one): offload copies a layer's input to the host asynchronously,
    while a CUDA graph's next replay writes over the memory that input lives in."""
    auto = isinstance(modes, str)
    if value in CUDA_GRAPH_MODES and (auto or any(m.offloads for m in modes if not isinstance(m, str))):
        named = "auto" if auto else [m.name for m in modes if not isinstance(m, str)]
        raise config_error(
            f"compile={value!r} with checkpoint={named}",
            f"the CUDA graphs of compile mode {value!r} write each replay's outputs over the last's, which "
            "offload is still copying to the host (and checkpoint='auto' may pick offload)",
            "use compile=True (or 'max-autotune-no-cudagraphs') with offload, or name modes without offload",
        )
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


def compile_layers(
    layers: nn.Sequential, value: Any, *, selective: Collection[int] = (), recomputed: Collection[int] = ()
) -> None:
    """Compiles each layer's forward in place, per the ``compile`` setting (False: nothing).

    Args:
        layers: the user's layers, in pipeline order.
        value: the ``compile`` setting.
        selective: the positions of the layers whose stage checkpoints selectively
            (:func:`selective_layers`): their compiled forward runs SAC's checkpoint inside.
        recomputed: the positions of the layers whose stage recomputes them
            (:func:`recomputed_layers`): compiled without CUDA graphs (module doc).
    """
    options = compile_options(value)
    if options is None:
        return
    for k, layer in enumerate(layers):
        if layer in _COMPILED:
            continue
        own = layer.__dict__.get("forward")
        forward = selective_region(layer.forward) if k in selective else layer.forward
        graphed = value in CUDA_GRAPH_MODES and k not in recomputed
        ungraphed = value in CUDA_GRAPH_MODES and not graphed
        compiled = torch.compile(forward, **(_WITHOUT_GRAPHS[value] if ungraphed else options))
        if graphed:
            compiled = _outputs_cloned(compiled)
        layer.__dict__["forward"] = compiled
        _COMPILED[layer] = (compiled, own)
        if k in selective:
            _SELECTIVE.add(layer)


def _outputs_cloned(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` returning copies of its tensors, outside the CUDA graphs' memory pool (module doc)."""

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten(compiled(*args, **kwargs))
        return tree_unflatten([x.clone() if isinstance(x, Tensor) else x for x in leaves], spec)

    return forward


def uncompiled() -> ContextManager[Any]:
    """Inside it, every compiled layer runs its own eager forward (``torch.compiler.set_stance``).

    The first micro-batch's check of escaping tensors (:mod:`pipeckpt.stages.escapes`) runs under it,
    so that it sees the layer's own ops and not the compiler's: the first call of a compiled layer
    traces and compiles it, and on an H200 (torch 2.11, inductor) left tensors of an activation's
    shape held by dicts and tuples, which the check refused as the layer's. That micro-batch's
    recompute runs under it too, so that it replays the ops (and dropout masks) of the forward it
    recomputes."""
    return torch.compiler.set_stance("force_eager")


def selective_layers(ranges: Sequence[tuple[int, int]], modes: Sequence[CheckpointMode]) -> FrozenSet[int]:
    """The positions of the layers of the stages whose mode is selective, from a plan's
    ``ranges`` and ``modes``."""
    return frozenset(k for (a, b), mode in zip(ranges, modes) if mode.selective for k in range(a, b))


def recomputed_layers(ranges: Sequence[tuple[int, int]], modes: Sequence[CheckpointMode]) -> FrozenSet[int]:
    """The positions of the layers of the stages that recompute them with the engine's own checkpoint
    (every checkpointing mode but selective, whose compiled layers recompute inside their graph)."""
    return frozenset(
        k
        for (a, b), mode in zip(ranges, modes)
        if mode.checkpoints and not mode.selective
        for k in range(a, b)
    )


def selective_in_graph(layers: nn.Module) -> bool:
    """Whether every layer of a stage's (or segment's) ``layers`` was compiled with SAC inside, so
    the stage runs them as they are, without a checkpoint of its own around them."""
    found = list(layers) if isinstance(layers, nn.Sequential) else [layers]
    return bool(found) and all(layer in _SELECTIVE for layer in found)


def uncompile_layers(layers: nn.Sequential) -> None:
    """Each layer compiled by :func:`compile_layers` gets back the forward it had."""
    for layer in layers:
        entry = _COMPILED.pop(layer, None)
        if entry is None:
            continue
        compiled, own = entry
        _SELECTIVE.discard(layer)
        if layer.__dict__.get("forward") is not compiled:
            continue  # someone (a module pipeline's restore) already took it off
        if own is None:
            del layer.__dict__["forward"]
        else:
            layer.__dict__["forward"] = own
