"""A model's layers cut to what one tensor-parallel rank computes, for profiling its activations.

Why cut rather than profile the layers whole: under torch's plain styles (what the distributed engine
applies inside a layer) a ``colwise`` Linear computes its slice of the output features and a
``rowwise`` one its slice of the input features before the all-reduce, so every tensor between the
two (attention's heads, the MLP's hidden features) is ``1/tp`` of the whole on each rank. A layer
profiled whole counted them in full: the layout search over-predicted Llama's tensor-parallel ranks
by 24-86% (benchmarks/RESULTS_layout.md). A Linear whose weight is narrowed to rank 0's shard runs
the same local shapes, and a model that reshapes by ``-1`` over its heads (transformers' attention
does, as its own ``tp_plan`` requires) runs with ``heads / tp`` of them.

Which parameter dimension a style splits is :mod:`pipeckpt.memory.split_dims`'s; which submodules a
plan names is the engine's own :func:`~pipeckpt.engines.distributed.model_plan.split_by`.
"""

from dataclasses import replace
from typing import Callable, List, Mapping, Tuple

from torch import nn

from pipeckpt.engines.distributed.model_plan import split_by
from pipeckpt.memory.profile import ModelProfile, param_bytes_of
from pipeckpt.memory.sequence_local import one_rank_sequence
from pipeckpt.memory.split_dims import split_dims

__all__: List[str] = []


def one_rank_profile(
    layers: nn.Sequential,
    plan: Mapping[str, str],
    tp: int,
    profiled: Callable[[], ModelProfile],
    *,
    sequence: bool = False,
) -> ModelProfile:
    """``profiled()`` of ``layers`` cut to one of ``tp`` ranks by ``plan`` (:func:`cut_to_one_rank`),
    its activations one rank's and its parameters' figures the whole layers': the memory model
    takes each rank's share of those from the plan itself (memory/sharding.py), which would
    otherwise divide them twice. ``sequence``: under sequence parallelism, the rank's part of the
    sequence too (:mod:`pipeckpt.memory.sequence_local`). ``layers`` is as it was afterwards (its
    parameters put back, the hooks removed), so ``checkpoint='auto'`` profiles the user's own model
    so: profiled whole, a tensor-parallel rank's activations were counted ``tp`` times over."""
    whole = [param_bytes_of(layer) for layer in layers.children()]
    narrowed = cut_to_one_rank(layers, plan, tp)
    if not narrowed:
        return profiled()
    # and its part of the sequence outside the split blocks (memory/sequence_local.py)
    hooks = one_rank_sequence(layers, plan, tp) if sequence else []
    try:
        cut = profiled()
    finally:
        for h in hooks:
            h.remove()
        for module, own, original in narrowed:
            setattr(module, own, original)
    kept = [
        replace(p, param_bytes=w[0], param_tensors=w[1], largest_param=w[2], frozen_bytes=w[3])
        for p, w in zip(cut.layers, whole)
    ]
    return replace(cut, layers=(*kept, *cut.layers[len(kept) :]))


def cut_to_one_rank(
    layers: nn.Sequential, plan: Mapping[str, str], tp: int
) -> List[Tuple[nn.Module, str, nn.Parameter]]:
    """Narrows, in place, every parameter that ``plan`` splits inside ``layers``' layers to rank 0's
    shard of ``tp`` (``ceil(size / tp)``, the largest, as torch's ``Shard`` gives the first ranks);
    returns each parameter it replaced, with its module and name, for a caller that puts them back
    (:func:`one_rank_profile` does)."""
    if tp <= 1:
        return []
    narrowed = []
    for layer in layers.children():
        for name, style in split_by(layer, dict(plan)).items():
            module = layer.get_submodule(name)
            for own, dim in split_dims(module, style).items():
                p = getattr(module, own, None)
                if not isinstance(p, nn.Parameter):
                    continue
                size = -(-p.shape[dim] // tp)
                setattr(module, own, nn.Parameter(p.detach().narrow(dim, 0, size).clone(), p.requires_grad))
                narrowed.append((module, own, p))
    return narrowed
