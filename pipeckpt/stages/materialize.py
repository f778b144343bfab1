"""A module built on the meta device, made real layer by layer: some layers for real, the rest drawn
and dropped, so that the real ones get the values an eager build with the same seed gives them.

An eager build draws every layer's initial values from one generator, in module order. A process
that keeps only some layers replays the same walk: each layer that owns tensors gets empty storage
and its own ``reset_parameters()``; another process's layer gets scratch storage for that call and
goes back to meta, so the generator advances by exactly its draws; past its own last layer it may
stop and learn the end state elsewhere (docs/DISTRIBUTED.md, "Built on the meta device").
Lightning's ``_materialize_distributed_module`` makes every layer real at once, which is the whole
model in one process, and unties shared parameters.
"""

import weakref
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import own_tensors, set_own_tensor
from pipeckpt._errors import config_error

__all__: List[str] = []

RULE = (
    "a module built on the meta device is initialised layer by layer, so every layer that owns "
    "parameters or buffers itself must have a reset_parameters() that sets all of them (torch's own "
    "layers do); the initial values are those calls' draws, in module order"
)


def on_meta(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters or buffers is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def check_materializable(module: nn.Module, *, name: str = "self") -> None:
    """Refuses ``module`` if a layer holding meta tensors cannot initialise itself, naming the first."""
    for sub_name, sub in module.named_modules():
        own = own_tensors(sub)
        if any(t.is_meta for _, t, _ in own) and not callable(getattr(sub, "reset_parameters", None)):
            where = f"{name}.{sub_name}" if sub_name else name
            held = ", ".join(n for n, _, _ in own)
            raise config_error(
                f"{where} ({type(sub).__name__}, holding {held}) is on the meta device and has no "
                "reset_parameters()",
                RULE,
                f"give {type(sub).__name__} a reset_parameters() that initialises {held}, or build the "
                "module eagerly (not in configure_model, nor under init_module(empty_init=True))",
            )


# The generators' states where the last meta build ended, until a strategy's set-up claims them for
# its module (:func:`claim_build`); then per module, so a build nobody made real never leaks into
# another module's draws.
_pending: List[Tuple[Tensor, Optional[Tensor]]] = []
_built_at: "weakref.WeakKeyDictionary[nn.Module, Tuple[Tensor, Optional[Tensor]]]" = (
    weakref.WeakKeyDictionary()
)


def remember_build(device: torch.device) -> None:
    """Notes the generators' states where a meta build ends: :func:`materialize` draws from there."""
    _pending[:] = [_states(device)]


def built_on_meta(module: nn.Module) -> bool:
    """Whether ``module`` was built on the meta device (in ``configure_model`` or under
    ``init_module(empty_init=True)``) and is not made real yet; not a module whose other stages a
    finished distributed run left on meta."""
    return module in _built_at and on_meta(module)


def claim_build(module: nn.Module) -> None:
    """The last meta build's end state becomes ``module``'s (its set-up follows that build)."""
    if _pending:
        _built_at[module] = _pending.pop()


def _states(device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_states(states: Tuple[Tensor, Optional[Tensor]], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


States = Tuple[Tensor, Optional[Tensor]]
# Given this process's generator states after every draw (None when it stopped early), the states
# after every draw, as a process that drew them all has them.
Agree = Callable[[Optional[States]], States]


@contextmanager
def _drawing_as_built(module: nn.Module, device: torch.device) -> Iterator[List[States]]:
    """The generators where the meta build ended; afterwards they stand past every draw (the last
    state the caller puts in the yielded list), as after an eager build, unless something moved
    them since the build (a re-seed): then they go back."""
    now = _states(device)
    built = _built_at.pop(module, None) or now
    moved = not all(torch.equal(a, b) for a, b in zip(now, built) if a is not None and b is not None)
    _set_states(built, device)
    end: List[States] = []
    try:
        yield end
    finally:
        if moved:
            _set_states(now, device)
        elif end:
            _set_states(end[-1], device)


def materialize(
    module: nn.Module,
    device: torch.device,
    *,
    keep: Optional[Callable[[Tensor], bool]] = None,
    agree: Optional[Agree] = None,
    name: str = "self",
) -> None:
    """``module``'s meta tensors made real on ``device`` (those ``keep`` accepts; all by default) and
    initialised by their layers' ``reset_parameters()``, in module order, the rest drawn and dropped.

    A tensor shared by several layers keeps one storage and the values of the first layer that
    initialises it (a later layer's call draws into scratch). Refuses a module a layer of which cannot
    initialise itself (:func:`check_materializable`) before anything is drawn.

    Args:
        module: the module, with some or all of its tensors on the meta device.
        device: where the kept tensors are made real (scratch storage lives there too, so the
            generator that draws is the one an eager build on ``device`` draws from).
        keep: which meta tensors become real in this process; the others stay on meta.
        agree: given, drawing stops after the last kept tensor, and ``agree`` gives the generators'
            states past every draw (from a process that drew them all).
        name: ``module``'s name in messages.
    """
    check_materializable(module, name=name)
    layers = [(n, m, own_tensors(m)) for n, m in module.named_modules()]
    layers = [(n, m, own) for n, m, own in layers if any(t.is_meta for _, t, _ in own)]
    last = len(layers)
    if agree is not None:  # after the last layer with a tensor to keep, only the generators move
        kept = [i for i, (_, _, own) in enumerate(layers) if any(_kept(t, keep) for _, t, _ in own)]
        last = kept[-1] + 1 if kept else 0
    real: Dict[int, Tensor] = {}  # id of a meta tensor -> the real tensor that replaces it
    with torch.no_grad(), _drawing_as_built(module, device) as end:
        for sub_name, sub, own in layers[:last]:
            _initialise(sub, own, device, real, keep, where=f"{name}.{sub_name}" if sub_name else name)
        if agree is not None:
            end.append(agree(_states(device) if last == len(layers) else None))


def _kept(t: Tensor, keep: Optional[Callable[[Tensor], bool]]) -> bool:
    return not t.is_meta or keep is None or keep(t)


def _initialise(
    layer: nn.Module,
    own: List[Tuple[str, Tensor, bool]],
    device: torch.device,
    real: Dict[int, Tensor],
    keep: Optional[Callable[[Tensor], bool]],
    *,
    where: str,
) -> None:
    """One layer's ``reset_parameters()``: into new storage for the tensors it makes real, into
    scratch for the others (kept elsewhere, real already, or initialised by an earlier layer)."""
    after: Dict[str, Tensor] = {}  # what each slot holds once the call is done
    for slot, t, is_param in own:
        fresh = t.is_meta and id(t) not in real and (keep is None or keep(t))
        empty = torch.empty_like(t, device=device)
        if fresh:
            real[id(t)] = nn.Parameter(empty, t.requires_grad) if is_param else empty
        after[slot] = real.get(id(t), t)
        set_own_tensor(layer, slot, real[id(t)] if fresh else _like(t, empty, is_param), is_param)
    floating = [getattr(layer, slot) for slot, _, _ in own if getattr(layer, slot).is_floating_point()]
    for t in floating:
        t.fill_(float("nan"))  # what reset_parameters() leaves unset shows
    layer.reset_parameters()  # type: ignore[operator]
    unset = [slot for slot, _, _ in own if _has_nan(getattr(layer, slot))]
    for slot, _, is_param in own:
        set_own_tensor(layer, slot, after[slot], is_param)
    if unset:
        raise config_error(
            f"{where}.reset_parameters() ({type(layer).__name__}) left {', '.join(unset)} unset",
            RULE,
            f"make {type(layer).__name__}.reset_parameters() initialise {', '.join(unset)}, or build the "
            "module eagerly (not in configure_model, nor under init_module(empty_init=True))",
        )


def _like(original: Tensor, storage: Tensor, is_param: bool) -> Tensor:
    return nn.Parameter(storage, original.requires_grad) if is_param else storage


def _has_nan(t: Tensor) -> bool:
    return bool(t.is_floating_point() and torch.isnan(t).any())
