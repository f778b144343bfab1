"""Every reach into torch's private names (torch.utils._python_dispatch, _pytree, pipelining's
_backward, the memory tools); DCP's metadata classes are :mod:`pipeckpt._compat.torch_dcp`'s,
torch.distributed's stage, FSDP2 and mesh helpers :mod:`pipeckpt._compat.torch_distributed`'s.

Each entry says why no public API serves; ``tests/test_compat.py`` checks each by name and
behaviour (the memory tools' changes against torch's own classes:
``tests/test_compat_memory_tools.py``).
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge

# The rendezvous store of the default group, which liveness beats into: torch exposes it
# only privately (init_process_group keeps it; there is no dist.get_store()).
from torch.distributed.distributed_c10d import _get_default_store as default_store

# The base of every BatchNorm flavour; the public classes have no common public base.
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

# -- torch ----------------------------------------------------------------------------
# Thread-local torch dispatch modes (FlopCounterMode, MemTracker) do not follow work into
# an engine's worker threads; torch has no public API to read or re-enter the stack.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as dispatch_mode_stack
from torch.utils._python_dispatch import _pop_mode as pop_dispatch_mode
from torch.utils._python_dispatch import _push_mode as push_dispatch_mode

# torch ships pytree utilities only under a private module name (no torch.utils.pytree).
# tree_is_leaf: whether torch's pytree treats an object as a leaf (registered node types,
# named tuples), asked by pipeckpt.boundaries.pytrees's walk for objects that are not built-in containers;
# register_pytree_node: so that torch's walks (the stage report's hooks) see the tensors inside
# pipeckpt.boundaries.pytrees.Flat, the flat form a boundary value keeps between stages.
from torch.utils._pytree import (
    TreeSpec,
    register_pytree_node,
    tree_flatten,
    tree_is_leaf,
    tree_map,
    tree_unflatten,
)


def accumulate_gradients(
    outputs: Sequence[Union[torch.Tensor, GradientEdge]],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> None:
    """``torch.autograd.backward(outputs, grad_outputs, inputs=inputs)`` without its Python
    argument checks (a third of a small stage's recompute overhead; autograd has already checked
    the gradients against the outputs): each input's gradient is added to its ``.grad``
    (in place where one exists) as soon as it is made. ``outputs`` may be gradient edges, as
    for ``torch.autograd.backward``: the output tensors themselves then need not stay alive."""
    Variable._execution_engine.run_backward(
        tuple(outputs), tuple(grad_outputs), False, False, tuple(inputs), True, True
    )


def accumulate_keeping_graph(
    outputs: Sequence[GradientEdge], grad_outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> None:
    """:func:`accumulate_gradients` that keeps the graph's saved tensors for a later backward over
    part of it (a split backward's weight pass)."""
    Variable._execution_engine.run_backward(
        tuple(outputs), tuple(grad_outputs), True, False, tuple(inputs), True, True
    )


# A split backward's input pass finds, as torch's zero-bubble stages do, the nodes where the
# weights' gradients meet the input's (torch exposes its stage_backward_input/_weight only whole,
# over a stage's outputs, which a stage's recompute Function holds inside).
from torch.distributed.pipelining._backward import (  # noqa: E402
    construct_reverse_graph as reverse_graph,
)
from torch.distributed.pipelining._backward import get_param_groups as param_groups  # noqa: E402


def apply_function(function: type, *args: Any) -> Any:
    """``function.apply(*args)`` for a ``torch.autograd.Function`` without the Python
    wrapper's per-argument functorch unwrapping and default-argument binding: a stage passes
    all its parameters through one call per micro-batch, and functorch transforms over a
    pipeline are not supported anyway."""
    return super(torch.autograd.Function, function).apply(*args)  # type: ignore[misc]


def apply_to_tensors(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *, recurse: bool = True
) -> None:
    """``module._apply(fn)``: moves parameters and buffers in place, keeping the
    Parameter objects (and so the optimizer's references); ``Module.to`` has no
    per-tensor rule (leave meta tensors alone) and no ``recurse=False``."""
    module._apply(fn, recurse=recurse)


def keep_buffers_out_of_state_dict(module: nn.Module, names: List[str]) -> None:
    """Makes existing buffers non-persistent: ``register_buffer(persistent=False)``
    exists only for new buffers."""
    module._non_persistent_buffers_set.update(names)


def own_tensors(module: nn.Module) -> List[Tuple[str, torch.Tensor, bool]]:
    """``module``'s own parameters and buffers (not its children's), each with whether it is a
    parameter, read from ``_parameters`` and ``_buffers``: ``named_parameters(recurse=False)``
    drops a second name of a tensor the module holds twice."""
    params = [(n, p, True) for n, p in module._parameters.items() if p is not None]
    return params + [(n, b, False) for n, b in module._buffers.items() if b is not None]


def own_tensor(module: nn.Module, name: str, is_param: bool) -> torch.Tensor:
    """The tensor in ``module``'s own slot ``name`` now (a parameter's or a buffer's), as
    :func:`own_tensors` lists it."""
    held = module._parameters[name] if is_param else module._buffers[name]
    assert held is not None, f"{name}: an empty slot"
    return held


def set_own_tensor(module: nn.Module, name: str, tensor: torch.Tensor, is_param: bool) -> None:
    """Puts ``tensor`` in ``module``'s slot ``name`` as it is: ``setattr`` would wrap or refuse it
    (a non-Parameter in a parameter's slot), and a buffer keeps its persistence."""
    if is_param:
        module._parameters[name] = tensor  # type: ignore[assignment]
    else:
        module._buffers[name] = tensor


def set_module_device(module: Any, device: torch.device) -> None:
    """``LightningModule.device`` reads ``_device``, which Lightning updates only
    through ``.to()``; a pipeline places its parts itself."""
    module._device = device


# -- memory model (pipeckpt.memory) ---------------------------------------------------

# Running a model without allocating its memory (a model larger than the machine): fake tensors
# exist only under torch._subclasses; torch has no public FakeTensorMode.
from torch._subclasses.fake_tensor import FakeTensorMode as _TorchFakeTensorMode  # noqa: E402

# The grouped matrix product (MoE experts) FakeTensorMode answers itself: only an aten name.
_GROUPED_MM = torch.ops.aten._grouped_mm.default


class FakeTensorMode(_TorchFakeTensorMode):
    """torch's fake tensor mode, its dispatch cache emptied as each mode is made. The cache is a
    class attribute shared by every mode in the process, and entries an earlier search left made a
    profile's counted memory depend on what ran before it (a GPT-2 layer's backward working set
    came out 256 bytes apart after another search in the same process; the op was not traced;
    tests/app/test_layout_no_plan.py), so it was turned off. Emptied, the entries a profile reads
    are its own ops': the later layers' repeats of the first's count what the first counted, as
    without the cache (tests/test_compat_memory_tools.py), and searches ran 1.35x-1.84x faster
    with it, their output equal (benchmarks/RESULTS_layout.md)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _TorchFakeTensorMode.cache.clear()

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """torch's, but for a grouped matrix product of float32 or float16 operands, which torch's
        meta kernel refuses (it checks the fast kernel's bfloat16 only, though CPU and CUDA run
        other dtypes by their fallback): an MoE model's experts under Hugging Face's ``grouped_mm``
        (the default on a GPU and on CPU since torch 2.11) failed every fake profile. Its result
        is the bfloat16 product's shape, in the operands' dtype (or ``out_dtype``); nothing but
        that result is counted, as nothing else of the kernel's outlives it."""
        kwargs = {} if kwargs is None else kwargs
        if func is not _GROUPED_MM:  # every other op, as torch dispatches it
            return super().dispatch(func, types, args, kwargs)
        bound = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args), **kwargs)
        a, b = bound["self"], bound["mat2"]
        if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
            return super().dispatch(func, types, args, kwargs)
        to = torch.ops.aten._to_copy.default
        half = [
            super(FakeTensorMode, self).dispatch(to, types, (t,), {"dtype": torch.bfloat16}) for t in (a, b)
        ]
        out = super().dispatch(func, types, (*half, bound.get("offs")), {})
        return super().dispatch(to, types, (out,), {"dtype": bound.get("out_dtype") or a.dtype})


# torch's per-operator memory accounting lives only in torch.distributed._tools (no public module
# counts the bytes of every tensor an operator creates, nor snapshots them per module).
from copy import deepcopy  # noqa: E402

from torch.distributed._tools.mem_tracker import _TOTAL_KEY  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker as _TorchMemTracker  # noqa: E402
from torch.utils.weak import WeakIdKeyDictionary  # noqa: E402


class _NoHook:
    def remove(self) -> None:
        pass


class _NamedWeakIdKeyDictionary(WeakIdKeyDictionary):
    """MemTracker's table of modules to their stats, which also finds the live entries whose stats
    carry one of some names without a walk of them all: an index by name, made anew after an
    entry is set or the table cleared (MemTracker only sets and clears it; a module collected
    since is skipped where the walk would have found it gone)."""

    def __init__(self) -> None:
        super().__init__()
        self._by_name: Optional[Dict[str, List[Tuple[Any, Any]]]] = None

    def __setitem__(self, key: Any, value: Any) -> None:
        self._by_name = None
        super().__setitem__(key, value)

    def clear(self) -> None:
        self._by_name = None
        super().clear()

    def active(self, names: Any) -> List[Any]:
        """The stats of the live modules whose ``mod_fqn`` is in ``names``."""
        if self._by_name is None:
            self._by_name = {}
            for ref, stats in self.data.items():
                self._by_name.setdefault(stats.mod_fqn, []).append((ref, stats))
        return [stats for n in names for ref, stats in self._by_name.get(n, ()) if ref() is not None]


class MemTracker(_TorchMemTracker):
    """torch's MemTracker, for modules with frozen parameters too. Entering a module, torch's
    registers a gradient hook on each of its parameters, which one that needs no gradient refuses
    (``cannot register a hook on a tensor that doesn't require gradient``: PEFT LoRA's base, any
    ``requires_grad_(False)``). A frozen parameter is entered in its private table of hooks (which
    ``_track_module_params_and_buffers`` reads and ``__exit__`` empties) as hooked already: it is
    still counted as a parameter, and no gradient of it comes to be tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.memory_tracking = _NamedWeakIdKeyDictionary()

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> Tuple[int, int]:
        hooked = self._param_to_grad_hook_handles
        for param in module.parameters():
            if not param.requires_grad and hooked.get(param) is None:
                hooked[param] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state: Any) -> None:
        """torch's update of each active module's peak, after every operator, in the time of the
        modules active now rather than of every module tracked: torch's walks them all (a weak
        dictionary, each entry dereferenced) to find the few whose name is among the active ones
        (14 of 83 s of a 4-layer HF Llama's search under cProfile, which inflates each call). The
        same modules are updated with the same snapshots."""
        tracking: _NamedWeakIdKeyDictionary = self.memory_tracking  # type: ignore[assignment]
        for mod_stats in tracking.active(self._mod_tracker.parents):
            if peak_state in mod_stats.snapshots:
                for dev, dev_snap in self._curr_mem_snap.items():
                    if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                        mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                        mod_stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)


# The module states MemTracker snapshots, by the values of its private ``_ModState`` enum.
MODULE_STATES = ("Pre-Forward", "Peak-Forward", "Post-Forward", "Pre-Backward", "Peak-Backward")


def module_memory(tracker: Any, module: nn.Module) -> Dict[str, int]:
    """Total tracked bytes (all devices) at each of :data:`MODULE_STATES` of ``module``'s first
    call under ``tracker`` (a :class:`MemTracker`). MemTracker keys its per-module snapshots by a
    private enum and its totals by a private key, and has no public per-module reader."""
    from torch.distributed._tools.mem_tracker import _ModState

    snapshots = tracker.memory_tracking[module].snapshots
    out: Dict[str, int] = {}
    for state in _ModState:
        if state.value in MODULE_STATES and snapshots.get(state):
            out[state.value] = sum(dev.get("Total", 0) for dev in snapshots[state][0].values())
    return out


# The aten kernels selective checkpointing keeps (matrix products, fused attention): the
# attention and scaled-mm kernels have only underscored names (there is no public op
# namespace for them); missing ones (another build) are skipped.
SAC_SAVED_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def sac_saved_ops() -> List[Any]:
    """The overload packets of :data:`SAC_SAVED_OP_NAMES` this torch has."""
    return [getattr(torch.ops.aten, n) for n in SAC_SAVED_OP_NAMES if hasattr(torch.ops.aten, n)]


# The aten batch-norm kernels, which write the running statistics in place: a compiled SAC region
# (pipeckpt/checkpointing/compiling.py) must save their outputs, as its backward would recompute
# them from statistics the next micro-batch has moved on (autograd's version check refuses it).
# Most have only underscored names; missing ones (another build) are skipped.
SAC_STATEFUL_OP_NAMES = (
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "_batch_norm_with_update",
    "cudnn_batch_norm",
    "miopen_batch_norm",
)


def sac_stateful_ops() -> List[Any]:
    """The overload packets of :data:`SAC_STATEFUL_OP_NAMES` this torch has."""
    return [getattr(torch.ops.aten, n) for n in SAC_STATEFUL_OP_NAMES if hasattr(torch.ops.aten, n)]


def is_view(t: Any) -> bool:
    """Whether ``t`` is a view of another tensor. A split-backward schedule's input pass detaches
    the stage's outputs in place, which autograd refuses for a view; no public API tells a view."""
    return bool(t._is_view())


def saved_tensors_hooks_now() -> Optional[Tuple[Callable[[Any], Any], Callable[[Any], Any]]]:
    """The (pack, unpack) pair of the innermost ``saved_tensors_hooks`` now active, or None. A hook
    pipeckpt installs inside a user's (``save_on_cpu``, say) shadows it; knowing it lets pipeckpt's
    call it in turn. torch offers no public way to read the active pair."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


__all__ = [
    "is_view",
    "BatchNormBase",
    "FakeTensorMode",
    "MODULE_STATES",
    "MemTracker",
    "SAC_SAVED_OP_NAMES",
    "TorchDispatchMode",
    "TreeSpec",
    "accumulate_gradients",
    "accumulate_keeping_graph",
    "apply_function",
    "apply_to_tensors",
    "default_store",
    "dispatch_mode_stack",
    "keep_buffers_out_of_state_dict",
    "module_memory",
    "own_tensors",
    "param_groups",
    "pop_dispatch_mode",
    "push_dispatch_mode",
    "register_pytree_node",
    "reverse_graph",
    "sac_saved_ops",
    "saved_tensors_hooks_now",
    "set_module_device",
    "set_own_tensor",
    "tree_flatten",
    "tree_is_leaf",
    "tree_map",
    "tree_unflatten",
]
