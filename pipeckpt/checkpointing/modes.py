"""Activation checkpoint modes, as objects: engines ask the mode; no code compares mode strings.

A mode is written ``<base>[+selective][:<k>]``: ``base`` is ``never``, ``except_last``, ``always``,
``offload`` or ``selective`` (``always+selective``); ``:k`` checkpoints every ``k`` layers as one
segment; ``+selective`` keeps matmul and attention outputs (torch's SAC). Why not torchgpipe's
``checkpoint`` argument: one global mode at whole-stage granularity, and no offload. Refused by name:
``never`` with ``:k`` or ``+selective``, and ``offload+selective`` (docs/DESIGN.md, checkpointing/modes).
"""

import re
from dataclasses import dataclass, replace
from typing import AbstractSet, Dict, Optional, Sequence, Tuple, Union

from pipeckpt._errors import config_error

__all__ = ["CheckpointMode", "NEVER", "EXCEPT_LAST", "ALWAYS", "OFFLOAD", "SELECTIVE", "parse_modes"]

ModeSpec = Union[str, "CheckpointMode", Sequence[Union[str, "CheckpointMode"]]]


@dataclass(frozen=True)
class CheckpointMode:
    """How one pipeline stage trades memory for recomputation.

    ``recompute_last`` is False only for ``except_last``, which keeps the micro-batches whose
    recompute buys no memory: those the engine's op order names (:func:`pipeckpt.checkpointing.order.kept`:
    the micro-batch whose backward comes first on the stage, and any whose backward follows
    its forward with nothing between). Under the local engine that is the last micro-batch
    (torchgpipe drains backward in reverse); under torch's GPipe and 1F1B it is micro-batch 0,
    and on the last stage of 1F1B every micro-batch. ``always`` recomputes every micro-batch
    whatever the order.

    Build one with :func:`parse_modes` or use the constants (``NEVER``, ``EXCEPT_LAST``,
    ``ALWAYS``, ``OFFLOAD``, ``SELECTIVE``); a setting takes the mode's name (``"always:1"``).

    Args:
        name: the mode as written, e.g. ``"except_last+selective:2"``.
        checkpoints: whether the stage drops activations and recomputes them at all.
        recompute_last: False only for ``except_last``: the micro-batches above are kept.
        offloads: whether the kept inputs wait in host memory (``offload``).
        every: layers per checkpointed segment (None: the whole stage as one).
        selective: keep the matmul outputs (torch's SAC) instead of only the segment inputs.
    """

    name: str
    checkpoints: bool
    recompute_last: bool
    offloads: bool
    every: Optional[int] = None
    selective: bool = False

    def recomputes(
        self, microbatch: int, num_microbatches: int, *, keep: Optional[AbstractSet[int]] = None
    ) -> bool:
        """Whether micro-batch ``microbatch`` (0-based) of ``num_microbatches`` keeps only its
        (segments') inputs and recomputes in backward. ``keep``: the micro-batches the engine's
        op order lets ``except_last`` keep; default the local engine's, the last one."""
        if not self.checkpoints:
            return False
        if self.recompute_last:
            return True
        return microbatch not in (keep if keep is not None else {num_microbatches - 1})

    def __str__(self) -> str:
        return self.name


NEVER = CheckpointMode("never", checkpoints=False, recompute_last=False, offloads=False)
EXCEPT_LAST = CheckpointMode("except_last", checkpoints=True, recompute_last=False, offloads=False)
ALWAYS = CheckpointMode("always", checkpoints=True, recompute_last=True, offloads=False)
OFFLOAD = CheckpointMode("offload", checkpoints=True, recompute_last=True, offloads=True)
SELECTIVE = CheckpointMode("selective", checkpoints=True, recompute_last=True, offloads=False, selective=True)

MODES: Dict[str, CheckpointMode] = {m.name: m for m in (NEVER, EXCEPT_LAST, ALWAYS, OFFLOAD, SELECTIVE)}

_SYNTAX = re.compile(r"^(?P<base>[a-z_]+)(?P<selective>\+selective)?(?::(?P<every>[^:]*))?$")
_HINT = (
    "write <base>[+selective][:<k>] with base one of never, except_last, always, offload, selective, e.g. "
    "'always:1' (each layer), 'except_last+selective', 'selective:2'; in the configs `ckpt=<name>` or "
    "`ckpt.modes=[...]`"
)


def _one(spec: Union[str, CheckpointMode]) -> CheckpointMode:
    if isinstance(spec, CheckpointMode):
        return spec
    text = str(spec)
    if text in MODES:
        return MODES[text]
    found = _SYNTAX.match(text)
    if found is None or found["base"] not in MODES:
        raise config_error(
            f"checkpoint mode {spec!r}",
            f"is not one of {', '.join(MODES)}, optionally with +selective and :k",
            _HINT,
        )
    mode = MODES[found["base"]]
    if found["selective"]:
        if not mode.checkpoints or mode.offloads:
            raise config_error(
                f"checkpoint mode {spec!r}",
                "never recomputes nothing, so there is nothing to select"
                if not mode.checkpoints
                else "offload keeps the stage's inputs on the host while selective keeps matmul outputs on "
                "the device; the two do not compose",
                "use except_last+selective or selective (= always+selective), or offload without +selective",
            )
        mode = replace(mode, selective=True)
    if found["every"] is not None:
        every = found["every"]
        if not every.isdigit() or int(every) < 1:
            raise config_error(
                f"checkpoint mode {spec!r}",
                f"the segment length {every!r} must be a whole number >= 1",
                _HINT,
            )
        if not mode.checkpoints:
            raise config_error(
                f"checkpoint mode {spec!r}",
                "never checkpoints nothing, so it has no segment length",
                "write never, or give a recomputing mode a segment length (e.g. always:1)",
            )
        mode = replace(mode, every=int(every))
    return replace(mode, name=text)


def parse_mode(spec: Union[str, CheckpointMode]) -> CheckpointMode:
    """One mode from its name (``'always'``, ``'always:1'``, ``'except_last+selective:2'``, ...)."""
    return _one(spec)


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
