"""Profiling one micro-batch, layer by layer: what each layer saves, its peaks and its times.

Why a profile and not a formula: what a layer saves for backward depends on its kernels (an
attention's math path saves its scores, a fused one does not), and storages shared between layers
(a tensor one layer returns and the next saves) count once. A saved-tensor hook names every
storage each layer saves; torch's ``MemTracker`` gives each layer's forward and backward peak
above what was live before it. Under ``fake=True`` the same runs on fake tensors (nothing
allocated). docs/MEMORY.md, "memory/profile.py", says more.
"""

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import AbstractSet, Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import FakeTensorMode, tree_flatten
from pipeckpt.boundaries.outside_uses import Handoffs
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.memory.memory_pass import Storages, memory_pass
from pipeckpt.memory.outside import OutsideMemory
from pipeckpt.memory.outside_share import OutsideParam, outside_params
from pipeckpt.memory.rooted import RootInput, measure_outside, outside_parameters, root_chain
from pipeckpt.memory.timing import _flop_pass, _selective_pass, _timing_pass
from pipeckpt.stages.gradients import gradients_set_aside

__all__ = ["Loss", "LayerProfile", "ModelProfile", "profile", "fake_mode"]

Loss = Callable[[Tensor, Any], Tensor]


@dataclass(frozen=True)
class LayerProfile:
    """One layer of the Sequential, for one micro-batch. Storages are named by integer ids that
    are unique within one :class:`ModelProfile`; their sizes are in ``ModelProfile.storage_bytes``."""

    name: str
    param_bytes: int  # bytes of its trained parameters (each gets a gradient and optimizer state)
    param_tensors: int  # how many trained parameter tensors
    largest_param: int  # bytes of its largest trained parameter (the gradient summed out of place)
    inputs: Tuple[int, ...]  # storages of the layer's input tensors
    outputs: Tuple[int, ...]  # storages of its output tensors
    saved: Tuple[int, ...]  # storages it saves for backward (parameters excluded)
    forward_peak: int  # peak bytes allocated by its forward above what was live before it
    backward_peak: int  # peak bytes of its backward above what was live before it
    forward_s: float
    backward_s: float
    # Selective checkpointing (torch's SAC, checkpointing/selective.py): the storages of the outputs of
    # the ops its policy keeps, and the forward seconds those ops take (a selective recompute skips them).
    sac_kept: Tuple[int, ...] = ()
    sac_s: float = 0.0
    # Seconds selective checkpointing adds to this layer's forward + backward, as measured (None:
    # not measured, fake tensors): on a dispatch-bound layer SAC's per-op dispatch mode and the
    # checkpoint's hooks cost more than the recompute SAC saves.
    sac_extra_s: Optional[float] = None
    # How many aten ops its forward runs: eager SAC's dispatch mode pays its host cost per op, which a
    # layer whose SAC cost was not measured (``sac_extra_s`` None) is charged from (memory/timing.py).
    ops: int = 0
    # The same with the gradient that arrives for its output held until its backward is over, as
    # a Function's backward holds it while the layer that ends its segment runs inside (None: as
    # ``backward_peak``, not measured).
    backward_held_peak: Optional[int] = None
    # Bytes of its frozen parameters (``requires_grad`` False: LoRA's base): held, no gradient, no state.
    frozen_bytes: int = 0
    # ``backward_held_peak`` where its parameters have no gradient yet (a step's first backward of
    # the layer): each weight gradient made is kept, not added into ``.grad`` and freed (None: as
    # ``backward_held_peak``, not measured).
    first_backward_peak: Optional[int] = None
    # Bytes a split backward's input pass keeps for the weight pass: the gradients recorded where its
    # weights join its input's path, every linear's output and a norm's (None: not measured, counted
    # as its outputs); and whether nothing of its input needs a gradient, so that a stage it begins
    # defers the whole backward to the weight pass (memory/memory_pass.py ``_split_held``).
    split_held: Optional[int] = None
    split_whole: bool = False
    # The most a weight pass of its allocates at once, its weight gradients adding into ``.grad``
    # (None: not measured, counted as ``backward_peak``): no input gradients, so far less.
    weight_pass_peak: Optional[int] = None


@dataclass(frozen=True)
class ModelProfile:
    """Every layer of one micro-batch's forward and backward, and the loss after the last layer."""

    layers: Tuple[LayerProfile, ...]
    storage_bytes: Dict[int, int]
    microbatch_size: int
    batch_inputs: Tuple[int, ...]  # the micro-batch's own storages (the data's, never counted)
    loss: Optional[LayerProfile] = None
    fake: bool = False
    # A pipeline_of model: its code outside the layers (``loss`` above), as it runs per micro-batch.
    outside: Optional[OutsideMemory] = None
    # A pipeline_of model: its parameters outside the layers and who reads each (None: not told, or
    # not such a model), for the ranks of the distributed engine, which hold what their stages read.
    outside_params: Optional[Tuple[OutsideParam, ...]] = None
    # A pipeline_of model: which layer outputs cross each stage boundary under the distributed
    # engine (None: not told, or not such a model; every earlier output crosses).
    handoffs: Optional[Handoffs] = None
    # Each storage's shape, as first seen (memory/vocab_share.py finds the logits' by it).
    storage_shapes: Dict[int, Tuple[int, ...]] = field(default_factory=dict)

    def bytes_of(self, ids: AbstractSet[int]) -> int:
        data = self._data
        return sum(self.storage_bytes[i] for i in ids if i not in data)

    @cached_property
    def _data(self) -> FrozenSet[int]:
        """``batch_inputs`` as a set: ``bytes_of`` asks it of every storage, millions of times a search."""
        return frozenset(self.batch_inputs)

    @cached_property
    def derived(self) -> Dict[Any, Any]:
        """Numbers other modules derive from this profile alone, kept with it (frozen, it never
        changes; :func:`dataclasses.replace` makes a profile with none): one stage's
        (:func:`pipeckpt.memory.stage_model.stage_model`), asked again by every prediction a search
        makes of a layout with the same stage."""
        return {}

    def saved_union(self, start: int, stop: int) -> Set[int]:
        out: Set[int] = set()
        for layer in self.layers[start:stop]:
            out.update(layer.saved)
        return out


class _LossLayer(nn.Module):
    """The loss as a module, so that MemTracker snapshots it like a layer."""

    def __init__(self, loss_fn: Loss, target: Any) -> None:
        super().__init__()
        self.loss_fn, self.target = loss_fn, target

    def forward(self, output: Tensor) -> Tensor:
        return self.loss_fn(output, self.target)


def param_bytes_of(module: nn.Module) -> Tuple[int, int, int, int]:
    """(bytes, tensors, largest) of the trained parameters, and the bytes of the frozen ones."""
    params = outside_parameters(module)
    params = list(module.parameters()) if params is None else params
    sizes = [p.numel() * p.element_size() for p in params if p.requires_grad]
    frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    return sum(sizes), len(sizes), max(sizes, default=0), frozen


@contextmanager
def _state_kept(sequential: nn.Module) -> Iterator[None]:
    """The profile leaves no trace: buffers (BatchNorm statistics), RNG and gradients as they were."""
    buffers = {k: b.clone() for k, b in sequential.named_buffers()}
    with torch.random.fork_rng(), gradients_set_aside(sequential.parameters()):
        try:
            yield
        finally:
            with torch.no_grad():
                for k, b in sequential.named_buffers():
                    b.copy_(buffers[k])


def profile(
    sequential: nn.Sequential,
    microbatch: Any,
    *,
    loss_fn: Optional[Loss] = None,
    target: Any = None,
    rounds: int = 3,
    fake: bool = False,
    flops_per_s: float = 100e12,
    split_backward: bool = True,
) -> ModelProfile:
    """Profiles one micro-batch through ``sequential``, layer by layer, in training mode. Module
    state, RNG and gradients are left as they were.

    Args:
        sequential: the layers the pipeline cuts into stages: a Sequential, or the
            :func:`~pipeckpt.pipeline_of` of a model, which runs from its own input through its
            own ``forward`` (memory/rooted.py; its code outside the layers counts as the loss).
        microbatch: the input of ``sequential``, already cut to one micro-batch; for a
            ``pipeline_of`` model, the arguments of its ``forward``
            (:class:`~pipeckpt.memory.rooted.RootInput`, or a tuple, dict or tensor as Lightning
            passes ``example_input_array``).
        loss_fn: ``loss_fn(output, target)``, the loss after the last layer (its memory sits on the
            last stage); without it, backward starts from a gradient of ones. Not used for a
            ``pipeline_of`` model, whose ``forward`` computes what it computes.
        target: the loss's second argument.
        rounds: timing rounds per layer (after one warm-up); the median is kept.
        fake: ``sequential`` and ``microbatch`` were built under :func:`fake_mode` (a model larger
            than the machine), or a meta build's tensors swapped for fake ones
            (:func:`~pipeckpt.memory.fake_weights.fake_weights`): nothing is allocated and times
            come from FLOP counts.
        flops_per_s: the rate FLOP counts are divided by under ``fake``.
        split_backward: measure what each layer's split backward holds between its input and
            weight passes (``LayerProfile.split_held``, ``split_whole``, ``weight_pass_peak``),
            which only a zero-bubble schedule's walk reads. False where none can run (``auto``'s
            schedules, ``predict``'s): the passes it takes cost a fifth of an HF Llama's profile.
    """
    owner: nn.Module = sequential.root if isinstance(sequential, ModulePipeline) else sequential
    was_training = owner.training
    owner.train()
    try:
        given = microbatch  # a pipeline_of model's call; the chain starts from its first layer's input
        layers, microbatch, loss, first = _chain(sequential, microbatch, loss_fn, target)
        leaves = [t for t in first if isinstance(t, Tensor) and t.dim()]
        size = int(leaves[0].shape[0]) if leaves else 1
        storages = Storages([*owner.parameters(), *owner.buffers()])
        data = storages.ids(first) if owner is not sequential else None
        with _state_kept(owner):
            records, batch_inputs = memory_pass(layers, microbatch, loss, storages, split=split_backward)
        with _state_kept(owner):
            outside = measure_outside(loss) if loss is not None else None
        readers, handoffs = None, None
        if isinstance(sequential, ModulePipeline):
            with _state_kept(owner):
                readers, handoffs = outside_params(sequential, RootInput.of(given))
        with _state_kept(owner):
            if fake:
                times = _flop_pass(layers, microbatch, loss, flops_per_s)
            else:
                with warnings.catch_warnings():
                    # A first layer whose input needs no gradient (token ids): its backward mark
                    # fires with its output's gradient, which is what the timing wants.
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    times = _timing_pass(layers, microbatch, loss, rounds)
                    sac_extra = _selective_pass(layers, microbatch, rounds)
    finally:
        owner.train(was_training)
    profiles = []
    for i, (record, (fwd, bwd)) in enumerate(zip(records, times)):
        module = loss if loss is not None and i == len(layers) else layers[i]
        pbytes, ptensors, largest, frozen = param_bytes_of(module) if module is not None else (0, 0, 0, 0)
        profiles.append(
            LayerProfile(
                name=type(sequential[i]).__name__ if i < len(layers) else "loss",
                param_bytes=pbytes,
                param_tensors=ptensors,
                largest_param=largest,
                frozen_bytes=frozen,
                inputs=record["inputs"],
                outputs=record["outputs"],
                saved=tuple(sorted(record["saved"])),
                forward_peak=max(0, record["forward_peak"]),
                backward_peak=max(0, record["backward_peak"]),
                backward_held_peak=max(0, record["backward_held_peak"]),
                first_backward_peak=max(0, record["first_backward_peak"]),
                forward_s=fwd,
                backward_s=bwd,
                sac_kept=tuple(sorted(record["sac"])),
                sac_s=fwd * _sac_share(record, fake),
                sac_extra_s=None if fake or i >= len(layers) else sac_extra[i],
                ops=record.get("ops", 0),
                split_held=record.get("split_held"),
                split_whole=record.get("split_whole", False),
                weight_pass_peak=record.get("weight_pass_peak"),
            )
        )
    return ModelProfile(
        layers=tuple(profiles[: len(layers)]),
        storage_bytes=dict(storages.bytes),
        microbatch_size=size,
        batch_inputs=batch_inputs if data is None else data,
        loss=profiles[len(layers)] if loss is not None else None,
        fake=fake,
        outside=outside,
        outside_params=readers,
        handoffs=handoffs,
        storage_shapes=dict(storages.shapes),
    )


def _chain(
    sequential: nn.Sequential, microbatch: Any, loss_fn: Optional[Loss], target: Any
) -> Tuple[List[nn.Module], Any, Optional[nn.Module], List[Any]]:
    """The layers the passes run, their first input, the module after them, and the leaves of the
    micro-batch itself. A ``pipeline_of`` model runs as the chain of memory/rooted.py, from its input
    (on fake tensors too: its forward is recorded on them as on real ones)."""
    if not isinstance(sequential, ModulePipeline):
        loss = _LossLayer(loss_fn, target) if loss_fn is not None else None
        return list(sequential), microbatch, loss, tree_flatten(microbatch)[0]
    call = RootInput.of(microbatch)
    with _state_kept(sequential.root):
        chain = root_chain(sequential, call)
    return list(chain.links), chain.first, chain.outside, tree_flatten((call.args, call.kwargs))[0]


def _sac_share(record: Dict[str, Any], fake: bool) -> float:
    """The share of a layer's forward time spent in the ops SAC keeps. Fake tensors run no kernels:
    there the times come from FLOPs, which the kept ops (matrix products, attention) carry."""
    if fake:
        return 1.0 if record["sac"] else 0.0
    total = record.get("op_s", 0.0)
    return min(1.0, record.get("sac_op_s", 0.0) / total) if total > 0 else 0.0


@contextmanager
def fake_mode() -> Iterator[Any]:
    """Build a model and its micro-batch inside this to profile them without allocating them
    (:func:`profile` with ``fake=True``)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode
