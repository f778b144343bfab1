"""Activation checkpoint modes, as objects.

A mode answers two questions for one stage: does micro-batch ``i`` of ``m``
drop its activations and recompute them in backward, and are the kept stage
inputs moved to host memory? Engines ask the mode; no code compares mode
strings. torchgpipe has one global mode and no offload, so per-stage modes and
offload live here, independent of any engine.
"""

from dataclasses import dataclass
from typing import Dict, Sequence, Tuple, Union

from pipeckpt._errors import config_error

__all__ = ["CheckpointMode", "NEVER", "EXCEPT_LAST", "ALWAYS", "OFFLOAD", "parse_modes"]

ModeSpec = Union[str, "CheckpointMode", Sequence[Union[str, "CheckpointMode"]]]


@dataclass(frozen=True)
class CheckpointMode:
    """How one pipeline stage trades memory for recomputation.

    ``recompute_last`` is False only for ``except_last``: under the local engine
    the last micro-batch of a step runs backward first (torchgpipe drains in
    reverse), so recomputing it would buy no memory, only time. torch's GPipe and
    1F1B (distributed engine) run it last: the same micro-batches are recomputed,
    but the mode saves less memory there.
    """

    name: str
    checkpoints: bool
    recompute_last: bool
    offloads: bool

    def recomputes(self, microbatch: int, num_microbatches: int) -> bool:
        """Whether micro-batch ``microbatch`` (0-based) of ``num_microbatches``
        keeps only its stage input and recomputes the stage in backward."""
        if not self.checkpoints:
            return False
        return self.recompute_last or microbatch < num_microbatches - 1

    def __str__(self) -> str:
        return self.name


NEVER = CheckpointMode("never", checkpoints=False, recompute_last=False, offloads=False)
EXCEPT_LAST = CheckpointMode("except_last", checkpoints=True, recompute_last=False, offloads=False)
ALWAYS = CheckpointMode("always", checkpoints=True, recompute_last=True, offloads=False)
OFFLOAD = CheckpointMode("offload", checkpoints=True, recompute_last=True, offloads=True)

MODES: Dict[str, CheckpointMode] = {m.name: m for m in (NEVER, EXCEPT_LAST, ALWAYS, OFFLOAD)}


def _one(spec: Union[str, CheckpointMode]) -> CheckpointMode:
    if isinstance(spec, CheckpointMode):
        return spec
    try:
        return MODES[str(spec)]
    except KeyError:
        raise config_error(
            f"checkpoint mode {spec!r}",
            f"is not one of {', '.join(MODES)}",
            "set `checkpoint` (`ckpt=<name>` or `ckpt.modes=[...]` in the configs) to one of those names",
        ) from None


def parse_modes(spec: ModeSpec, stages: int) -> Tuple[CheckpointMode, ...]:
    """One mode for every stage, or a list with exactly one mode per stage."""
    if isinstance(spec, (str, CheckpointMode)):
        return (_one(spec),) * stages
    modes = [_one(s) for s in spec]
    if len(modes) != stages:
        raise config_error(
            f"checkpoint modes {[m.name for m in modes]} ({len(modes)} modes)",
            f"a per-stage list needs exactly one mode per stage, and there are {stages} stages",
            f"give {stages} modes, or a single mode name for all stages",
        )
    return tuple(modes)
