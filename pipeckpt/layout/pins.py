"""The layout settings a user names beside ``strategy.layout=auto``: the search keeps them and
searches the rest (``strategy.tensor_parallel=2 strategy.layout=auto``: the best layout with tp 2).

Why: a user often knows part of the answer (this model is only ever run at tp 8 here; the
schedule must be 1F1B for a comparison; the chunk count is fixed by a data loader). Until
2026-12-06 such a setting was overwritten by the pick without a word, as a named checkpoint mode
had been before (:func:`pipeckpt.plan_pick.given_modes`). Each pin compares a setting as the
strategy reads it with the candidate's own field, so ``schedule=Interleaved1F1B`` and
``interleaved_1f1b`` pin the same layouts.
"""

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.schedules import lookup
from pipeckpt.layout.candidates import Candidate, Model

__all__ = ["PINNABLE", "Pins"]


def _same_schedule(c: Candidate, name: Any) -> bool:
    return lookup(c.schedule).cls is lookup(str(name)).cls


#: Each setting a user may pin, and whether a candidate keeps its value.
_KEEPS: Dict[str, Callable[[Candidate, Any], bool]] = {
    "stages": lambda c, v: c.stages == int(v),
    "virtual_stages": lambda c, v: c.virtual_stages == int(v),
    "tensor_parallel": lambda c, v: c.tp == int(v),
    "dp": lambda c, v: c.dp == int(v),
    "dp_shard": lambda c, v: c.dp_shard == int(v),
    "data_parallel": lambda c, v: c.settings()["data_parallel"] == str(v),  # as the pick trains it
    "schedule": _same_schedule,
    "chunks": lambda c, v: c.chunks == int(v),
    "balance": lambda c, v: c.stages == len(v),
    "reshard_after_forward": lambda c, v: c.reshard == bool(v),
    "reduce_every_microbatch": lambda c, v: c.reduce_every == bool(v),
}

#: The strategy settings a search can be kept to (``strategy.NAME=VALUE`` on the command line).
PINNABLE: Tuple[str, ...] = tuple(_KEEPS)


@dataclass(frozen=True)
class Pins:
    """Settings by name (:data:`PINNABLE`), each as the strategy reads it; empty: nothing pinned."""

    values: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "schedule" in self.values:
            lookup(str(self.values["schedule"]))  # an unknown name is refused by name, before any work

    def __bool__(self) -> bool:
        return bool(self.values)

    @property
    def balance(self) -> Tuple[int, ...]:
        """The layers per stage given (empty: the search cuts the stages)."""
        return tuple(int(n) for n in self.values.get("balance") or ())

    def text(self) -> str:
        """The pins as the command line gives them: ``strategy.tensor_parallel=2 strategy.chunks=4``."""
        return " ".join(f"strategy.{k}={_shown(v)}" for k, v in self.values.items())

    def kept(
        self, found: Sequence[Candidate], model: Model, world: int, global_batch: int
    ) -> List[Candidate]:
        """The layouts of ``found`` that keep every pin, cut by the pinned balance where one is
        given; a configuration error naming the pins where none does."""
        if not self:
            return list(found)
        out = [c for c in found if all(_KEEPS[k](c, v) for k, v in self.values.items())]
        if self.balance:
            out = [replace(c, balance=self.balance) for c in out]
        if not out:
            raise config_error(
                f"strategy.layout=auto with {self.text()}",
                self._reason(model)
                or f"no layout the engine runs on {world} devices at a global batch of {global_batch} "
                "has all of these (pp x tp x dp is the world; the schedule's micro-batch rules; "
                "micro-batches divide the batch a replica takes)",
                "drop or change one of them: the search chooses what is not given",
            )
        return out

    def _reason(self, model: Model) -> str:
        """Why the model itself rules the pins out, where it does ("" where the world or batch do)."""
        tp = int(self.values.get("tensor_parallel") or 1)
        heads = [h for h in (model.heads, model.kv_heads) if h]
        if tp > 1 and not model.tensor_parallel:
            return (
                "the model is not split by tensor parallelism here: it takes no tensor_parallel "
                "argument and has no plan of its own (pipeline_of reads config.base_model_tp_plan)"
            )
        if tp > 1 and any(h % tp for h in heads):
            return f"tensor parallelism splits the attention heads ({heads}), so its degree divides them"
        stages = self.values.get("stages")
        if stages is not None and int(stages) > model.layers:
            return f"a stage holds at least one of the model's {model.layers} pipelined layers"
        return ""


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return f"[{','.join(map(str, value))}]"
    return str(value)
