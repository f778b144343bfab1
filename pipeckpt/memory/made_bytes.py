"""The bytes of the storages made under a dispatch mode that are still alive, and their most since a
mark: what a stretch of work (a split backward's weight pass, memory/memory_pass.py) holds at once
above where it began, net of what it frees.

Why not torch's ``MemTracker``: its peak runs from the moment it is entered and cannot be read
from a later point, and a storage made before it entered is never seen to be freed; a weight pass
frees the gradients and saved tensors its input pass and forward left, which is the point. Why not
the benchmarks' ``harness.live_bytes.LiveBytes``: it lives outside the package, and it counts a
storage an op returns the first time it sees it, so a weight gradient added into an existing
``.grad`` in place would count as made; here a storage any of the op's arguments held is not.
"""

import weakref
from typing import Dict, List, Set

from torch import Tensor

from pipeckpt._compat import TorchDispatchMode, tree_flatten

__all__: List[str] = []


class MadeBytes(TorchDispatchMode):
    """Counts each storage an op's output brings that none of its arguments held (an in-place op's
    or a view's is its argument's), until that storage is freed; works on fake tensors too."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: Dict[int, int] = {}

    def mark(self) -> int:
        """The bytes alive now, from which :attr:`peak` runs again."""
        self.peak = self.live
        return self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given: Set[int] = {
            id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in given or key in self._sizes:
                continue
            self._sizes[key] = storage.nbytes()
            self.live += self._sizes[key]
            weakref.finalize(storage, self._freed, key)
        self.peak = max(self.peak, self.live)
        return out

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
