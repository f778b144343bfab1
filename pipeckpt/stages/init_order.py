"""The order in which an eager build draws a module's initial values, as steps a process can replay
one at a time on a module built on the meta device (:mod:`pipeckpt.stages.materialize`).

A layer of torch draws in its constructor through its own ``reset_parameters()``. A Hugging Face
model (``PreTrainedModel``) first builds its children so, then, at the end of its constructor,
initialises every module of its own anew by the model's ``_init_weights(module)``, children before
parents (HF's ``initialize_weights``), skipping the modules an inner model has already initialised
(a ``LlamaModel`` inside a ``LlamaForCausalLM``). ``_init_weights`` also sets buffers such as the
rotary frequencies, and may write a child's tensors (GPT-2's attention scales its ``c_proj``); which
tensors one call writes is learnt by running it once on the meta device, where nothing is drawn.
"""

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from pipeckpt._compat import (
    hf_init_weights,
    is_hf_model,
    own_tensor,
    own_tensors,
    set_own_tensor,
    tree_flatten,
)

__all__: List[str] = []

# A tensor's place: the module that holds it, its name there, whether it is a parameter.
Slot = Tuple[nn.Module, str, bool]


def held(slot: Slot) -> Tensor:
    """The tensor in ``slot`` now."""
    return own_tensor(*slot)


@dataclass
class Step:
    """One initialising call: ``call()`` sets (some of) the tensors in ``slots``."""

    where: str  # the module's name in messages
    layer: nn.Module
    call: Callable[[], Any]
    slots: List[Slot]
    strict: bool  # a reset_parameters() outside any HF model: it must set every tensor it holds


def initialiser_of(module: nn.Module) -> Optional[str]:
    """What initialises ``module``'s own tensors: its ``reset_parameters()``, or the Hugging Face
    model around it; None for neither (only ``module``'s ancestors decide the latter)."""
    return "reset_parameters()" if callable(getattr(module, "reset_parameters", None)) else None


def in_hf_models(module: nn.Module) -> Set[int]:
    """The ids of the modules inside a Hugging Face model of ``module`` (the models included)."""
    return {id(sub) for m in module.modules() if is_hf_model(m) for sub in m.modules()}


def init_steps(module: nn.Module, name: str) -> List[Step]:
    """Every initialising call of an eager build of ``module``, in the order it makes them."""
    steps: List[Step] = []
    seen: Set[int] = set()  # modules walked
    initialised: Set[int] = set()  # modules a Hugging Face model's initialisation has reached

    def walk(m: nn.Module, where: str, in_hf: bool) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if is_hf_model(m):
            for child_name, child in m.named_children():
                walk(child, f"{where}.{child_name}", True)
            for sub_where, sub, init in _post_order(m, where, hf_init_weights(m)):
                if id(sub) not in initialised:  # not by an inner model already
                    initialised.add(id(sub))
                    slots = _touched(sub, partial(init, sub))
                    if slots:
                        steps.append(Step(sub_where, sub, partial(init, sub), slots, strict=False))
            return
        own = own_tensors(m)
        if own and initialiser_of(m) is not None:
            slots = [(m, n, p) for n, _, p in own]
            steps.append(Step(where, m, m.reset_parameters, slots, strict=not in_hf))  # type: ignore[arg-type]
        for child_name, child in m.named_children():
            walk(child, f"{where}.{child_name}", in_hf)

    walk(module, name, False)
    return steps


def _post_order(
    m: nn.Module, where: str, init: Callable[[nn.Module], None]
) -> Iterator[Tuple[str, nn.Module, Callable[[nn.Module], None]]]:
    """HF's ``initialize_weights`` order: children first; an inner model's modules by its own init."""
    for child_name, child in m.named_children():
        inner = hf_init_weights(child) if is_hf_model(child) else init
        yield from _post_order(child, f"{where}.{child_name}", inner)
    yield where, m, init


class _Seen(TorchFunctionMode):
    """Notes every tensor a call passes to torch."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: Set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ids.update(id(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor))
        return func(*args, **kwargs)


def _touched(sub: nn.Module, call: Callable[[], Any]) -> List[Slot]:
    """The slots of ``sub``'s tensors (its children's included) that ``call`` reaches, learnt by
    running it with every tensor on the meta device (a stand-in for a real one); all of them if it
    cannot run there."""
    slots: List[Slot] = [(o, n, p) for o in sub.modules() for n, _, p in own_tensors(o)]
    real = {i: held(slot) for i, slot in enumerate(slots) if not held(slot).is_meta}
    for i, t in real.items():
        stand_in = torch.empty_like(t, device="meta")
        owner, name, is_param = slots[i]
        set_own_tensor(
            owner, name, nn.Parameter(stand_in, t.requires_grad) if is_param else stand_in, is_param
        )
    seen = _Seen()
    try:
        with torch.no_grad(), seen:
            call()
        reached = [s for s in slots if id(held(s)) in seen.ids]
    except Exception:  # an init that needs real values: assume it touches everything below it
        reached = slots
    finally:
        for i, t in real.items():
            set_own_tensor(slots[i][0], slots[i][1], t, slots[i][2])
    return reached
