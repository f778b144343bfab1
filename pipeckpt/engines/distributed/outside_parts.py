"""A module pipeline's parts outside its layers, held only by the stages that read them.

Every stage replays the model's ``forward`` (``.rooted``), so every stage calls the input embedding,
but only the first stage's layers read its output: elsewhere that output is dropped at the first
layer call, which returns what the earlier stage sent. Which stages read each outside parameter is
probed once (:func:`pipeckpt.boundaries.outside_uses.outside_uses`, on rank 0's first batch, on fake
tensors); a rank holds the outside parameters of its own stages' reads and no other (they stay on,
or go to, the meta device: not materialised, not read from a pretrained directory, never given a
gradient, so no optimizer state). Where a module outside the layers is not held, its calls are
answered by zeros of the shapes, dtypes and device its own ``forward`` gives (worked out on meta
tensors): the values are read by nothing this rank computes, and the shapes keep the model's own
code (masks, rotary tables, dropout's draws) as it runs with the real module.

A parameter whose holders cannot be told (the probe failed: no batch before a fit, an op fake
tensors cannot run; or code outside its module reads it) is held by every stage, as before.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from pipeckpt._compat import fit_train_loader, own_tensors, set_own_tensor, tree_flatten, tree_map
from pipeckpt.boundaries.outside_uses import OutsideUses, outside_uses
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.engines.distributed.replay import capture_call

__all__ = ["OutsideParts", "agreed_uses", "drop", "held_parameters", "outside_parts"]


@dataclass
class OutsideParts:
    """This rank's share of a module pipeline's parameters outside the layers.

    Args:
        stages: each outside parameter's name -> the stages that hold it.
        held: the names of this rank's outside parameters (in the model passed to ``pipeline_of``).
        dropped: ids of the outside tensors this rank does not hold (those of a meta build stay
            the same tensors; a held one of it is replaced when made real, hence names above).
        standing_in: the modules outside the layers whose calls zeros answer on this rank.
        shardable: the modules outside the layers this rank shards under ``data_parallel='fsdp'``,
            innermost first: each holds parameters of its own that no other module holds and that
            no other pipeline rank holds (a weight tied across ranks is summed whole: ``.ties``).
        sent: per stage, the leaves of layer outputs it sends the next (``.handoffs``; None: all).
        counts: per layer, the tensor leaves of its output as probed.
    """

    stages: Dict[str, Tuple[int, ...]]
    held: List[str]
    dropped: Set[int]
    standing_in: List[nn.Module] = field(default_factory=list)
    shardable: List[nn.Module] = field(default_factory=list)
    sent: Optional[Tuple[FrozenSet[Tuple[int, int]], ...]] = None
    counts: Tuple[int, ...] = ()

    def shardable_tensors(self) -> Set[int]:
        """Ids of the parameters of :attr:`shardable` now (a meta build's, before they are made real)."""
        return {id(t) for m in self.shardable for _, t, is_param in own_tensors(m) if is_param}


def agreed_uses(module: LightningModule, spec: ModulePipeline, device: torch.device) -> Optional[OutsideUses]:
    """Rank 0's :class:`OutsideUses` of ``spec``'s model on every rank (None: not told, every stage
    holds every outside parameter, and rank 0 warns why)."""
    found: List[Any] = [None]
    if dist.get_rank() == 0:
        try:
            found[0] = _probe(module, spec, device)
        except Exception as error:  # any failure of the model's code on fake tensors: hold everything
            found[0] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], str):
        rank_zero_warn(
            f"pipeline_of({type(spec.root).__name__}, ...): every pipeline stage holds the parameters "
            f"outside the layers whole, since which stages read them could not be told ({found[0]}). Set "
            "example_input_array on your LightningModule to the model's input, or pass a train loader "
            "to fit()."
        )
        return None
    return found[0]


def _probe(module: LightningModule, spec: ModulePipeline, device: torch.device) -> Optional[OutsideUses]:
    """The uses on the call the module's ``training_step`` makes on the fit's first batch (or on
    ``example_input_array``), the caller's generators left as they were."""
    example = getattr(module, "example_input_array", None)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if example is not None:
            args, kwargs = (
                (tuple(example), {})
                if isinstance(example, tuple)
                else ((), dict(example))
                if isinstance(example, dict)
                else ((example,), {})
            )
        else:
            try:
                trainer = module.trainer
            except RuntimeError:  # not attached to a Trainer: no fit to read a batch of
                trainer = None
            loader = fit_train_loader(trainer) if trainer is not None else None
            if loader is None:
                raise RuntimeError("no training batch before the fit")
            with _generators_kept(loader):
                batch = next(iter(loader))
            args, kwargs = capture_call(module, spec.root, "training_step", batch, (0,), {})  # type: ignore[arg-type]
        try:
            return outside_uses(spec, tuple(args), dict(kwargs), device)
        except Exception:  # code that reads values (a mask compared with a causal one): on the real tensors
            if any(t.is_meta for t in (*spec.root.parameters(), *spec.root.buffers())):
                raise
            return outside_uses(spec, tuple(args), dict(kwargs), device, fake=False)


@contextmanager
def _generators_kept(loader: Any) -> Iterator[None]:
    """Within, ``loader`` may be read: the generators it and its samplers draw from (a shuffled
    order, its workers' seeds) are set back after, so that this rank reads what the others read."""
    found: Dict[int, torch.Generator] = {}
    for holder in (
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        g = getattr(holder, "generator", None)
        if isinstance(g, torch.Generator):
            found[id(g)] = g
    states = [(g, g.get_state()) for g in found.values()]
    try:
        yield
    finally:
        for g, state in states:
            g.set_state(state)


def outside_parts(
    spec: ModulePipeline,
    uses: Optional[OutsideUses],
    ranges: Sequence[Tuple[int, int]],
    mine: Sequence[int],
    ranks: Sequence[Sequence[int]],
) -> OutsideParts:
    """This rank's :class:`OutsideParts` for stages ``mine`` of ``ranges`` (the layers' index
    ranges); ``ranks``: the stages of every rank of the pipeline, so that every rank agrees on which
    stages hold each parameter (their ties' process groups are made from it)."""
    root = spec.root
    inside = {id(p) for p in spec.parameters()}
    named = [(n, p) for n, p in root.named_parameters() if id(p) not in inside]
    every = tuple(range(len(ranges)))
    stages = {n: every for n, _ in named} if uses is None else uses.stages(ranges, [n for n, _ in named])
    # A parameter some rank cannot leave out, since no module can answer for it there, is held by all.
    changed = True
    while changed:
        changed = False
        for held_by in ranks:
            dropped = {id(p) for n, p in named if not set(stages[n]) & set(held_by)}
            covered = {id(p) for m in _standing_in(spec, dropped) for p in m.parameters()}
            for n, p in named:
                if id(p) in dropped and id(p) not in covered:
                    stages[n], changed = every, True
    dropped = {id(p) for n, p in named if not set(stages[n]) & set(mine)}
    held = [n for n, p in named if id(p) not in dropped]
    rank_of = {j: r for r, js in enumerate(ranks) for j in js}
    alone = {id(p) for n, p in named if id(p) not in dropped and len({rank_of[j] for j in stages[n]}) == 1}
    handoffs = uses.handoffs if uses is not None else None
    return OutsideParts(
        stages,
        held,
        dropped,
        _standing_in(spec, dropped),
        _shardable(spec, alone),
        sent=handoffs.sent(ranges) if handoffs is not None else None,
        counts=handoffs.counts if handoffs is not None else (),
    )


def _shardable(spec: ModulePipeline, alone: Set[int]) -> List[nn.Module]:
    """The modules outside the layers (none above them) whose own parameters are all in ``alone``
    and held by no other module, deepest first (FSDP2 shards a child before its parent)."""
    layers = {id(m) for layer in spec for m in layer.modules()}
    around = {id(m) for name in spec.names for m in _ancestors(spec.root, name)}
    holders: Dict[int, int] = {}
    for m in spec.root.modules():
        for _, t, is_param in own_tensors(m):
            if is_param:
                holders[id(t)] = holders.get(id(t), 0) + 1
    found: List[Tuple[int, nn.Module]] = []
    for name, m in spec.root.named_modules():
        if id(m) in layers or id(m) in around:
            continue
        own = [t for _, t, is_param in own_tensors(m) if is_param]
        if own and all(id(t) in alone and holders[id(t)] == 1 for t in own):
            found.append((name.count("."), m))
    return [m for _, m in sorted(found, key=lambda pair: -pair[0])]


def held_parameters(root: nn.Module, parts: OutsideParts) -> List[Tuple[str, nn.Parameter]]:
    """This rank's outside parameters as they are now, by name (a meta build made them real since)."""
    named = dict(root.named_parameters())
    return [(n, named[n]) for n in parts.held]


def _standing_in(spec: ModulePipeline, dropped: Set[int]) -> List[nn.Module]:
    """The largest modules outside the layers all of whose parameters are ``dropped``."""
    layers = {id(m) for m in spec}
    around = {id(m) for name in spec.names for m in _ancestors(spec.root, name)}
    found: List[nn.Module] = []
    taken: Set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in layers or id(child) in taken:
                continue
            params = list(child.parameters())
            if id(child) not in around and params and all(id(p) in dropped for p in params):
                found.append(child)
                taken.update(id(m) for m in child.modules())
                continue
            visit(child)

    visit(spec.root)
    return found


def _ancestors(root: nn.Module, name: str) -> List[nn.Module]:
    """The modules on the path from ``root`` to its submodule ``name``, both included."""
    path, module = [root], root
    for part in name.split("."):
        module = getattr(module, part)
        path.append(module)
    return path


def drop(root: nn.Module, parts: OutsideParts, device: torch.device) -> None:
    """The tensors this rank does not hold to the meta device (a tied one stays one tensor), and
    each module standing in answered by zeros of its output's shapes (on its inputs' device, else
    on ``device``, this rank's)."""
    made: Dict[int, Tensor] = {}
    for module in root.modules():
        for name, t, is_param in own_tensors(module):
            if id(t) in parts.dropped and not t.is_meta:
                if id(t) not in made:
                    meta = torch.empty_like(t, device="meta")
                    made[id(t)] = nn.Parameter(meta, t.requires_grad) if is_param else meta
                set_own_tensor(module, name, made[id(t)], is_param)
    for module in parts.standing_in:
        module.forward = _zeros_of(module.forward, module, device)


def _zeros_of(own: Callable[..., Any], module: nn.Module, fallback: torch.device) -> Callable[..., Any]:
    """``module``'s forward answered by zeros: its own ``forward`` run on meta tensors (its buffers
    on meta for the call) gives the shapes and dtypes; the device is its real inputs'."""

    def zeros(*args: Any, **kwargs: Any) -> Any:
        devices = [t.device for t in _tensors((args, kwargs)) if not t.is_meta]
        device = devices[0] if devices else fallback
        on_meta = tree_map(lambda t: t.to("meta") if isinstance(t, Tensor) else t, (args, kwargs))
        buffers = [
            (m, n, t) for m in module.modules() for n, t, p in own_tensors(m) if not p and not t.is_meta
        ]
        for m, n, t in buffers:
            set_own_tensor(m, n, t.to("meta"), False)
        try:
            with torch.no_grad():
                shapes = own(*on_meta[0], **on_meta[1])
        finally:
            for m, n, t in buffers:
                set_own_tensor(m, n, t, False)
        return tree_map(
            lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device) if isinstance(t, Tensor) else t,
            shapes,
        )

    return zeros


def _tensors(value: Any) -> List[Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]
