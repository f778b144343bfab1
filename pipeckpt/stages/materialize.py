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
from pipeckpt.stages.init_order import Step, held, in_hf_models, init_steps, initialiser_of
from pipeckpt.weights.pretrained import fill, in_checkpoint, marked_in

__all__: List[str] = []

RULE = (
    "a module built on the meta device is initialised layer by layer, so every layer that owns "
    "parameters or buffers itself must have a reset_parameters() that sets all of them (torch's own "
    "layers do), sit in a Hugging Face model (initialised by its _init_weights), or be filled from a "
    "checkpoint (pipeckpt.pretrained); the initial values are those calls' draws, in module order"
)
_EAGERLY = "or build the module eagerly (not in configure_model, nor under init_module(empty_init=True))"


def on_meta(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters or buffers is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def check_materializable(module: nn.Module, *, name: str = "self") -> None:
    """Refuses ``module`` if a layer holding meta tensors cannot initialise itself (no
    ``reset_parameters()``, outside any Hugging Face model) and no checkpoint fills them, naming the first."""
    hf, filled = in_hf_models(module), in_checkpoint(module)
    for sub_name, sub in module.named_modules():
        own = own_tensors(sub)
        unset = any(t.is_meta and id(t) not in filled for _, t, _ in own)
        if unset and id(sub) not in hf and initialiser_of(sub) is None:
            where = f"{name}.{sub_name}" if sub_name else name
            held_names = ", ".join(n for n, _, _ in own)
            raise config_error(
                f"{where} ({type(sub).__name__}, holding {held_names}) is on the meta device and has no "
                "reset_parameters()",
                RULE,
                f"give {type(sub).__name__} a reset_parameters() that initialises {held_names}, fill it "
                f"from a checkpoint with pipeckpt.pretrained, {_EAGERLY}",
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


def build_pending() -> bool:
    """Whether a meta build ended that no strategy's set-up has claimed yet."""
    return bool(_pending)


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
    initialised as an eager build initialises them (:mod:`pipeckpt.stages.init_order`: each layer's
    ``reset_parameters()``, then a Hugging Face model's ``_init_weights`` per module), in that order,
    the other tensors' draws made into scratch and dropped; or, for a module :func:`pipeckpt.pretrained`
    marked, read from its checkpoint, and only what the checkpoint lacks initialised so (without
    moving the generators).

    A tensor shared by several layers keeps one storage and the values of the first call that
    initialises it (a later layer's call draws into scratch, as in an eager build, where the tie
    comes after). Refuses a module a layer of which cannot initialise itself
    (:func:`check_materializable`) before anything is drawn.

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
    from_checkpoint = bool(marked_in(module))
    with torch.no_grad(), _drawing_as_built(module, device) as end:
        if from_checkpoint:
            end.append(_states(device))  # what the checkpoint lacks is drawn, the generators kept
            fill(module, device, keep)
            agree = None
        steps = [s for s in init_steps(module, name) if any(held(slot).is_meta for slot in s.slots)]
        kept = [i for i, s in enumerate(steps) if any(_kept_meta(held(slot), keep) for slot in s.slots)]
        if from_checkpoint:  # only the kept layers' own calls: no draw to replay
            steps = [steps[i] for i in kept]
        last = len(steps)
        if agree is not None:  # after the last layer with a tensor to keep, only the generators move
            last = kept[-1] + 1 if kept else 0
        real: Dict[int, Tensor] = {}  # id of a meta tensor -> the real tensor that replaces it
        made: Dict[int, Tuple[int, str]] = {}  # id of a real tensor made here -> the slot it was made in
        replaced: List[Tensor] = []  # the meta tensors replaced, alive while their ids are keys
        for step in steps[:last]:
            _initialise(step, device, real, made, keep, replaced)
        _resolve(module, real)
        if agree is not None:
            end.append(agree(_states(device) if last == len(steps) else None))
    _check_set(module, made, keep, name)


def _kept_meta(t: Tensor, keep: Optional[Callable[[Tensor], bool]]) -> bool:
    return t.is_meta and (keep is None or keep(t))


def _initialise(
    step: Step,
    device: torch.device,
    real: Dict[int, Tensor],
    made: Dict[int, Tuple[int, str]],
    keep: Optional[Callable[[Tensor], bool]],
    replaced: List[Tensor],
) -> None:
    """One initialising call: into new storage for the tensors it makes real, in place for those it
    made real itself earlier (a Hugging Face model's init after the layer's constructor), into
    scratch for the others (kept elsewhere, real already, or made real by an earlier layer)."""
    after: List[Tensor] = []  # what each slot holds once the call is done
    unset_watch: List[int] = []  # slots filled with NaN, so what the call leaves unset shows
    for i, slot in enumerate(step.slots):
        owner, slot_name, is_param = slot
        t = held(slot)
        t = real.get(id(t), t)  # made real through another slot of a tied tensor
        where = (id(owner), slot_name)
        if t.is_meta and (keep is None or keep(t)):
            empty = torch.empty_like(t, device=device)
            now = nn.Parameter(empty, t.requires_grad) if is_param else empty
            real[id(t)], made[id(now)] = now, where
            replaced.append(t)
            after.append(now)
            unset_watch.append(i)
        elif made.get(id(t)) == where:
            now = t  # this slot's own tensor again: HF's init overwrites the constructor's values
            after.append(t)
        else:
            now = _like(t, torch.empty_like(t, device=device), is_param)
            after.append(t)
            unset_watch.append(i)
        set_own_tensor(owner, slot_name, now, is_param)
    for i in unset_watch:
        if held(step.slots[i]).is_floating_point():
            held(step.slots[i]).fill_(float("nan"))
    step.call()
    unset = [step.slots[i][1] for i in unset_watch if _has_nan(held(step.slots[i]))]
    for (owner, slot_name, is_param), t in zip(step.slots, after):
        set_own_tensor(owner, slot_name, t, is_param)
    if unset and step.strict:
        kind = type(step.layer).__name__
        raise config_error(
            f"{step.where}.reset_parameters() ({kind}) left {', '.join(unset)} unset",
            RULE,
            f"make {kind}.reset_parameters() initialise {', '.join(unset)}, {_EAGERLY}",
        )


def _resolve(module: nn.Module, real: Dict[int, Tensor]) -> None:
    """Every slot still holding a meta tensor made real through another slot gets the real one."""
    for owner in module.modules():
        for slot_name, t, is_param in own_tensors(owner):
            if id(t) in real:
                set_own_tensor(owner, slot_name, real[id(t)], is_param)


def _check_set(
    module: nn.Module, made: Dict[int, Tuple[int, str]], keep: Optional[Callable[[Tensor], bool]], name: str
) -> None:
    """Refuses a kept tensor that no initialising call reached (still on meta) or set (its NaN shows)."""
    for sub_name, sub in module.named_modules():
        for slot_name, t, _ in own_tensors(sub):
            if _kept_meta(t, keep) or (id(t) in made and _has_nan(t)):
                where = f"{name}.{sub_name}" if sub_name else name
                raise config_error(
                    f"{where}.{slot_name} ({type(sub).__name__}) is left unset by its initialisation",
                    RULE,
                    f"initialise {slot_name} in {type(sub).__name__}.reset_parameters() or the model's "
                    f"_init_weights, fill it from a checkpoint with pipeckpt.pretrained, {_EAGERLY}",
                )


def _like(original: Tensor, storage: Tensor, is_param: bool) -> Tensor:
    return nn.Parameter(storage, original.requires_grad) if is_param else storage


def _has_nan(t: Tensor) -> bool:
    """Whether ``t`` holds a NaN, by a reduction (the maximum propagates NaN), not ``isnan(t).any()``:
    that allocates a mask a quarter of a float32 ``t``'s size per layer, and glibc's heap kept the
    freed masks (under its mmap threshold, fragmented by small allocations between them): a process
    making 12 Linear(4096, 4096) real held up to 208 MiB of freed masks at train start."""
    return bool(t.is_floating_point() and t.numel() > 0 and torch.amax(t).isnan())
