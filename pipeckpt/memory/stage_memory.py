"""What the walk (:mod:`pipeckpt.memory.walk`) predicts for one stage, and how it keeps its peak.

Why it keeps more than the largest total: the walk counts the stage's parameters, gradients and
optimizer state whole, and a rank of a sharded layout holds a share of them (memory/sharding.py).
The op where the whole totals peak need not be where a rank's do: unsharded, a 405B stage's optimizer
step (every gradient beside its optimizer state) outweighs the backward that holds 126 layers'
activations; sharded 256 ways, the backward is hundreds of GiB and the step tens. So the walk keeps,
for each amount of gradients held (none before the first backward, some during it, all after), the
op holding the most else; a rank's peak is the largest of those with its own shares (``per_rank``).
"""

from dataclasses import dataclass, field
from typing import Dict, Tuple

__all__ = ["Candidate", "StageMemory"]

# (gradient bytes held, activations, boundary, working, op): the op holding the most beside
# that amount of gradients.
Candidate = Tuple[int, int, int, int, str]


@dataclass(frozen=True)
class StageMemory:
    """One stage's predicted memory (bytes) and time (seconds) per training step."""

    stage: int
    layers: Tuple[int, int]  # (start, stop) in the Sequential
    mode: str
    params: int  # every parameter it holds, trained and frozen
    grads: int  # held at the peak (all of them, unless the peak falls in the first backward)
    optimizer: int
    activations: int  # held for backward by the micro-batches in flight, at the peak
    boundary: int  # stage inputs, received gradients and loss buffers, at the peak
    working: int  # recompute and the running layer's own working set, at the peak
    peak: int  # params + grads + optimizer + the rest at the peak moment
    in_flight: int  # most micro-batches held at once
    recomputed: int  # micro-batches recomputed per step
    time_s: float  # the stage's own compute per step, recompute included
    peak_at: str  # the op at which the peak falls, e.g. "B3 layer 5"
    frozen: int = 0  # of ``params``, those that need no gradient: no gradient, no optimizer state
    # Per amount of gradients held, the op holding the most beside it (the peak's among them).
    candidates: Tuple[Candidate, ...] = field(default=(), compare=False)


@dataclass
class _Peak:
    """The largest total seen so far, its parts and the op it fell in; and per amount held beside
    the parts (the stage's state and the gradients so far), the largest parts."""

    value: int = -1
    parts: Tuple[int, int, int] = (0, 0, 0)  # activations, boundary, working
    at: str = ""
    in_flight: int = 0
    by_held: Dict[int, Tuple[int, Tuple[int, int, int], str]] = field(default_factory=dict)

    def see(self, value: int, parts: Tuple[int, int, int], at: str) -> None:
        if value > self.value:
            self.value, self.parts, self.at = value, parts, at
        rest = parts[0] + parts[1] + parts[2]
        held = value - rest
        best = self.by_held.get(held)
        if best is None or rest > best[0]:
            self.by_held[held] = (rest, parts, at)

    def candidates(self, static: int) -> Tuple[Candidate, ...]:
        """The ops kept, each with the gradients it holds beyond ``static`` (the stage's parameters
        and optimizer state)."""
        return tuple((held - static, *parts, at) for held, (_, parts, at) in sorted(self.by_held.items()))
