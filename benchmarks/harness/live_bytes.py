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

A storage can also change size in place, which no operator reports: FSDP2 frees a unit's gathered
parameters by ``UntypedStorage.resize_(0)`` and gathers them again into the same storage (torch's
``_fsdp_param.free_storage``/``alloc_storage``). Counted at its first size until it dies, a unit
resharded after its forward would be held the whole step, as ``reshard_after_forward=False`` holds
it. So while counting, ``UntypedStorage.resize_`` is wrapped (as ``MemTracker._track_resize``
wraps it) and a counted storage's bytes follow its size.
"""

import weakref
from functools import wraps
from typing import Any, Dict, Optional, Sequence

import torch
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
        self._bytes: Dict[int, int] = {}  # each counted storage's bytes as last counted
        self._resize: Optional[Any] = None  # UntypedStorage.resize_ as it was before __enter__

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
                    self._add(st, size)
        self._top(op or "before the step")

    def _add(self, st: Any, size: int) -> None:
        self._seen[id(st)] = weakref.ref(st, lambda _, k=id(st): self._released(k))
        self._bytes[id(st)] = size
        self.live += size

    def _top(self, op: str) -> None:
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, op

    def count_step_state(self, module: nn.Module, optimizers: Sequence[Optimizer], batch: Any) -> None:
        """Counts what exists as a training step begins: the module's parameters and gradients,
        the optimizers' state and the batch."""
        self.count([*module.parameters(), *(p.grad for p in module.parameters())])
        self.count([list(o.state.values()) for o in optimizers])
        self.count(batch)

    def _released(self, key: int) -> None:
        self._seen.pop(key, None)
        self.live -= self._bytes.pop(key, 0)

    def _resized(self, st: Any) -> None:
        """A storage's new size: a counted one's bytes follow it; an uncounted one grown is counted."""
        size, key = st.nbytes(), id(st)
        if key in self._seen:
            self.live += size - self._bytes[key]
            self._bytes[key] = size
        elif size > 0:
            self._add(st, size)
        self._top("UntypedStorage.resize_")

    def __enter__(self) -> "LiveBytes":
        original = self._resize = torch.UntypedStorage.resize_

        @wraps(original)
        def resize_(st: Any, size: int) -> Any:
            out = original(st, size)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
            self._resize = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.count(out, op=str(func))
        return out
