"""The outputs a Hugging Face model records inside its layers, carried out of a layer's call through
its return value.

transformers' ``capture_outputs`` gives a model's forward a dict of lists through a context variable,
and forward hooks on submodules inside the layers append what they record to it: the routers' logits
(``output_router_logits``, which the MoE load-balancing loss reads), the attention weights
(``output_attentions``). Appended from inside a layer, such a tensor leaves the stage's autograd
Function by a side channel, with the stage's graph (stages/escapes.py refuses that). So a pipelined
layer's call records into lists of its own and returns what they got beside its output: through the
Function, whose backward then takes their gradients too (its recompute records them again), and only
then are they appended to the model's lists, as the Function's outputs. Hidden states are recorded by
hooks on the layers themselves, which run outside the call on what it returned: those lists stay the
model's.

A profile of a ``pipeline_of`` model (memory/rooted.py) runs the model's own code with its layers
answering what they returned in a recorded forward: their insides do not run, so nothing records
there, and HF's load-balancing loss finds no router logits. What each layer recorded in that forward
is noted (:func:`recorded_so_far`, :func:`recorded_since`) and appended again where it answers
(:func:`replay`).
"""

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from pipeckpt._compat import output_collector

__all__ = ["Recording", "recording", "recorded_since", "recorded_so_far", "replay"]

_OWN_KEYS = ("hidden_states",)  # recorded on the layers' own outputs: left to the model's lists


class Recording:
    """The model's lists of one running forward, and how a layer's call records apart from them.

    Args:
        lists: the running forward's dict of lists (``output_collector().get()``).
    """

    __slots__ = ("keys", "lists")

    def __init__(self, lists: Dict[str, Any]) -> None:
        self.lists = lists
        self.keys: Tuple[str, ...] = tuple(k for k in lists if not k.startswith("_") and k not in _OWN_KEYS)

    def carried(self, fn: Callable[..., Any]) -> Callable[..., Tuple[Any, Tuple[Tuple[Any, ...], ...]]]:
        """``fn`` (a layer's own forward) returning ``(its output, what it recorded, per key)``."""
        collector, keys, lists = output_collector(), self.keys, self.lists
        assert collector is not None, "a Recording is made while transformers records"

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Tuple[Any, Tuple[Tuple[Any, ...], ...]]:
            own: Dict[str, Any] = {k: ([] if k in keys else v) for k, v in lists.items()}
            token = collector.set(own)
            try:
                out = fn(*args, **kwargs)
            finally:
                collector.reset(token)
            return out, tuple(tuple(own[k]) for k in keys)

        run.__self__ = getattr(fn, "__self__", None)  # type: ignore[attr-defined]  # kv_caches reads it
        return run

    def add(self, recorded: Sequence[Sequence[Any]]) -> None:
        """Appends what one call recorded (its outputs through the Function) to the model's lists."""
        for key, values in zip(self.keys, recorded):
            self.lists[key].extend(values)


def recording() -> Optional[Recording]:
    """The running forward's recording of outputs inside the layers, or None (nothing recorded there)."""
    collector = output_collector()
    lists: Optional[Dict[str, List[Any]]] = collector.get() if collector is not None else None
    if not lists:
        return None
    found = Recording(lists)
    return found if found.keys else None


def recorded_so_far() -> Dict[str, int]:
    """How many outputs the running forward has recorded inside the layers, per key ({}: none)."""
    found = recording()
    return {k: len(found.lists[k]) for k in found.keys} if found is not None else {}


def recorded_since(so_far: Dict[str, int]) -> Dict[str, Tuple[Any, ...]]:
    """What the running forward recorded inside the layers after ``so_far`` (:func:`recorded_so_far`)."""
    found = recording()
    if found is None:
        return {}
    return {k: tuple(found.lists[k][n:]) for k, n in so_far.items() if k in found.lists}


def replay(recorded: Dict[str, Tuple[Any, ...]]) -> None:
    """Appends ``recorded`` (a layer's, :func:`recorded_since`) to the running forward's lists, as the
    layer's insides would have, where the layer answers without running them."""
    found = recording()
    for key, values in recorded.items():
        if found is not None and key in found.lists:
            found.lists[key].extend(values)
