"""The peak of the bytes alive during a training step, counted without holding anything.

Why not torch's ``MemTracker``: its module tracking registers a gradient hook on every module's
input, and the hook keeps that input alive while the hook lives. A layer recomputed under selective
checkpointing runs its forward inside a recompute Function on a detached copy of its input, whose
hook never fires, so under ``MemTracker`` each such layer's input outlives the step: the tracker
measures memory that exists only because it is tracking (one hidden state per selective layer, on
top of the optimizer's peak). This tracker only counts: every storage an operator creates, by its
bytes, from its creation to its release (a weak reference), as ``MemTracker`` and
:class:`harness.stage_memory.StageTracker` count, plus the storages handed to :meth:`count` that
exist before the step (parameters, gradients, the optimizer's state).
"""

import weakref
from typing import Any, Dict, Optional, Sequence

from torch import Tensor, nn
from torch.optim import Optimizer

from pipeckpt._compat import TorchDispatchMode, tree_flatten

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the storages counted under it; ``peak_op`` names the operator at the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.peak_op = ""
        self._seen: Dict[int, Any] = {}

    def count(self, value: Any, *, op: Optional[str] = None) -> None:
        """Counts the storages of ``value``'s tensors not counted yet, until each is released. A
        tensor on the meta device holds no memory: the distributed engine leaves another rank's
        stages there (their parameters keep the model's structure), and their storages still report
        their bytes, so they are not counted."""
        for t in tree_flatten(value)[0]:
            if isinstance(t, Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                size = st.nbytes()
                if id(st) not in self._seen and size > 0:
                    self._seen[id(st)] = weakref.ref(st, lambda _, k=id(st), n=size: self._released(k, n))
                    self.live += size
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, op or "before the step"

    def count_step_state(self, module: nn.Module, optimizers: Sequence[Optimizer], batch: Any) -> None:
        """Counts what exists as a training step begins: the module's parameters and gradients,
        the optimizers' state and the batch."""
        self.count([*module.parameters(), *(p.grad for p in module.parameters())])
        self.count([list(o.state.values()) for o in optimizers])
        self.count(batch)

    def _released(self, key: int, size: int) -> None:
        self._seen.pop(key, None)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.count(out, op=str(func))
        return out
