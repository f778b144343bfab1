"""RNG states: in a checkpoint, and agreed between processes.

In a checkpoint as tensors and plain Python values only, so that a checkpoint still loads with
``torch.load(weights_only=True)`` (Lightning's default for strategies that do not ask otherwise, e.g.
a run without pipeckpt); Lightning's own collector keeps a numpy array, which weights_only refuses.
Agreed between processes instead of reseeded (Lightning's ``reset_seed``, which DDP calls): a reseed
throws away what the script drew since ``seed_everything`` (the model's initial weights), which the
local engine's one process keeps, so the two engines' dropout would differ."""

import contextlib
import random
from typing import Any, Dict, Iterator, List

import numpy as np
import torch
import torch.distributed as dist

__all__: List[str] = []


def collect() -> Dict[str, Any]:
    numpy_state = np.random.get_state(legacy=True)
    # The legacy global generator is always MT19937, whose state numpy gives as a tuple.
    assert isinstance(numpy_state, tuple), "numpy's global generator is MT19937"
    kind, keys, pos, has_gauss, cached = numpy_state
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def forked_random_states() -> Iterator[None]:
    """Within: draw freely; after: every generator (torch's, CUDA's, Python's, numpy's) as before,
    so work done for the run (a layout search) leaves the script's draws as they were."""
    state = collect()
    try:
        yield
    finally:
        restore(state)


def agree(device: torch.device) -> None:
    """Every process takes global rank 0's torch generators: the CPU one, and ``device``'s when it is a
    GPU. The processes ran the same script, so this changes nothing unless they drew differently;
    then too each stage draws what the local engine's process would."""
    cuda = device.type == "cuda"
    states: List[Any] = [torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None]
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0])
    if cuda:
        torch.cuda.set_rng_state(states[1], device)
