"""RNG states in a checkpoint, as tensors and plain Python values only, so that
a checkpoint still loads with ``torch.load(weights_only=True)`` (Lightning's
default for strategies that do not ask otherwise, e.g. a run without pipeckpt).
Lightning's own collector keeps a numpy array, which weights_only refuses."""

import random
from typing import Any, Dict, List

import numpy as np
import torch

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
