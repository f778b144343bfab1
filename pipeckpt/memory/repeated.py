"""Identical layers profile alike: profile a run of them once, repeat it in the profile.

Why: a decoder is the same block 32 to 126 times, and profiling on fake tensors costs seconds per
layer whatever its size; three copies of the block (the first after the embedding, one in the
middle, the last before the head) hold every storage pattern a block has, so the middle copy is
repeated with fresh storage ids, each copy's input being the previous copy's output.
"""

from dataclasses import replace
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.boundaries.outside_uses import Handoffs, Leaf
from pipeckpt.memory.profile import LayerProfile, ModelProfile

__all__ = ["identical_run", "shortened", "repeat_layer"]


def _signature(layer: nn.Module) -> Tuple[object, ...]:
    return (type(layer), tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()))


def identical_run(sequential: nn.Sequential) -> Tuple[int, int]:
    """``(start, stop)`` of the longest run of consecutive layers of one class with parameters of the
    same names, shapes and dtypes (``(0, 1)`` where there is none longer than one).

    Args:
        sequential: the layers the pipeline cuts.
    """
    layers = list(sequential)
    best, start = (0, 1), 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or _signature(layers[i]) != _signature(layers[start]):
            if i - start > best[1] - best[0]:
                best = (start, i)
            start = i
    return best


def shortened(sequential: nn.Sequential, keep: int = 3) -> Tuple[nn.Sequential, int, int]:
    """``sequential`` with its longest identical run cut to ``keep`` layers (the same objects), the
    index of the run's middle layer in it, and how many times that layer must stand in the full
    profile (:func:`repeat_layer`).

    Args:
        sequential: the layers the pipeline cuts.
        keep: layers of the run to profile (at least 3: first, middle, last).
    """
    start, stop = identical_run(sequential)
    layers = list(sequential)
    if stop - start <= keep:
        return sequential, start, 1
    short = nn.Sequential(*layers[: start + keep - 1], layers[stop - 1], *layers[stop:])
    return short, start + 1, stop - start - keep + 1


def repeat_layer(profile: ModelProfile, index: int, count: int) -> ModelProfile:
    """``profile`` with layer ``index`` standing ``count`` times in a row: each copy takes the previous
    copy's outputs as inputs and owns fresh storages of the same sizes for everything else it makes
    and saves; the layer after the run reads the last copy's outputs.

    Args:
        profile: a profile whose layer ``index`` is followed by a layer that takes its outputs.
        index: the layer to repeat (neither the first nor the last).
        count: how many copies stand in the result (1 leaves the profile as it is).
    """
    layers = list(profile.layers)
    if not 0 < index < len(layers) - 1 or count < 1:
        raise config_error(
            f"repeat layer {index} x {count} of {len(layers)}",
            "only an inner layer repeats, at least once",
            "pass the middle layer of an identical run",
        )
    if count == 1:
        return profile
    layer = layers[index]
    sizes = dict(profile.storage_bytes)
    fresh = max(sizes, default=-1) + 1
    # What the layer made: not its inputs, nor what existed before it ran (a pipeline_of model's
    # rotary cos and sin, made before the first layer and saved by every layer, stay shared).
    before = set(profile.batch_inputs).union(*(_ids(earlier) for earlier in layers[:index]))
    own = (set(layer.saved) | set(layer.outputs) | set(layer.sac_kept)) - set(layer.inputs) - before
    copies: List[LayerProfile] = [layer]
    previous: Dict[int, int] = {i: i for i in own}  # the last copy's ids of the layer's own storages
    for _ in range(count - 1):
        mapping: Dict[int, int] = {}
        for i in sorted(own):
            mapping[i], sizes[fresh] = fresh, sizes[i]
            fresh += 1
        mapping.update({i: previous[o] for i, o in zip(layer.inputs, layer.outputs) if o in previous})
        copies.append(_renamed(layer, mapping))
        previous = {i: mapping[i] for i in own}
    after = _renamed(layers[index + 1], {o: previous[o] for o in layer.outputs if o in previous})
    new = layers[:index] + copies + [after] + layers[index + 2 :]
    return replace(
        profile,
        layers=tuple(new),
        storage_bytes=sizes,
        outside_params=_shifted(profile, index, count),
        handoffs=_repeated_handoffs(profile.handoffs, index, count),
    )


def _shifted(profile: ModelProfile, index: int, count: int) -> Any:
    """A ``pipeline_of`` model's outside parameters with their readers renumbered: the layers after
    ``index`` move ``count - 1`` on, and every copy of layer ``index`` reads what it reads."""
    if profile.outside_params is None:
        return None

    def moved(layers: FrozenSet[int]) -> FrozenSet[int]:
        copies = set(range(index, index + count)) if index in layers else set()
        return frozenset({i if i < index else i + count - 1 for i in layers if i != index} | copies)

    return tuple(replace(o, layers=moved(o.layers)) for o in profile.outside_params)


def _repeated_handoffs(h: Optional[Handoffs], index: int, count: int) -> Optional[Handoffs]:
    """A ``pipeline_of`` model's handoffs with layer ``index`` standing ``count`` times: each copy
    reads what it read, its predecessor's outputs for the layer before's; a later reader of its
    output reads the last copy's, or every copy's where it reads the layer before's too (the model's
    loss reads every layer's router logits)."""
    if h is None:
        return None
    copies = range(index, index + count)

    def moved(k: int) -> int:
        return k if k < index else k + count - 1

    def later(leaves: FrozenSet[Leaf]) -> FrozenSet[Leaf]:
        out: Set[Leaf] = set()
        for k, n in leaves:
            if k != index:
                out.add((moved(k), n))
            elif (index - 1, n) in leaves:
                out.update((c, n) for c in copies)
            else:
                out.add((index + count - 1, n))
        return frozenset(out)

    def own(c: int) -> FrozenSet[Leaf]:
        return frozenset((c - 1 if k == index - 1 else k, n) for k, n in h.reads[index])

    reads = [*h.reads[:index], *(own(c) for c in copies), *(later(r) for r in h.reads[index + 1 :])]
    opaque = {(moved(k), n) for k, n in h.opaque if k != index} | {
        (c, n) for k, n in h.opaque if k == index for c in copies
    }

    def spread(values: Tuple[Any, ...]) -> Tuple[Any, ...]:
        return (*values[:index], *[values[index]] * count, *values[index + 1 :]) if values else values

    return Handoffs(tuple(reads), later(h.output), frozenset(opaque), spread(h.counts), spread(h.sizes))


def _ids(layer: LayerProfile) -> FrozenSet[int]:
    return frozenset((*layer.inputs, *layer.outputs, *layer.saved, *layer.sac_kept))


def _renamed(layer: LayerProfile, mapping: Dict[int, int]) -> LayerProfile:
    def ids(values: Tuple[int, ...]) -> Tuple[int, ...]:
        return tuple(mapping.get(i, i) for i in values)

    return replace(
        layer,
        inputs=ids(layer.inputs),
        outputs=ids(layer.outputs),
        saved=tuple(sorted(ids(layer.saved))),
        sac_kept=tuple(sorted(ids(layer.sac_kept))),
    )
