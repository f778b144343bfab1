"""``checkpoint="auto"`` under ``memory_budget``: the plan chosen before the stages are built.

Why not in an engine: the choice needs the model, one batch and the settings, nothing an engine
builds, and once made it is ordinary settings, so every engine builds what it would have built
from the same settings written by hand. Where the batch comes from: docs/DESIGN.md, memory/budget.
"""

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import tree_flatten
from pipeckpt._errors import config_error
from pipeckpt.boundaries.contract import pipelined_sequential
from pipeckpt.engines import engine_class
from pipeckpt.memory.auto import DEFAULT_MODES, Choice, choose, parse_bytes
from pipeckpt.memory.profile import ModelProfile, profile
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.partition import plan as make_plan

__all__ = [
    "AutoPlan",
    "resolve_auto",
    "resolve_for",
    "sample_batch",
    "chunk_candidates",
    "balance_candidates",
    "first_microbatch",
]

#: Above this many balances, the search keeps to balances near the default one.
MAX_BALANCES = 2000


@dataclass(frozen=True)
class AutoPlan:
    """The settings with the chosen plan written in, and the choice behind them."""

    settings: PipeSettings
    choice: Choice
    budget: int
    #: The profile of one micro-batch per candidate chunk count that the choice was made from.
    profiles: Dict[int, ModelProfile] = field(default_factory=dict, repr=False, compare=False)

    def describe(self) -> str:
        p = self.choice.prediction
        peaks = ", ".join(f"{s.peak / 2**20:.1f}" for s in p.stages)
        whole = self.choice.process_peak
        # Every stage on one device: the budget bounds the whole process, which is what was planned.
        peak = (
            f"predicted peak of the one device (all stages) {whole / 2**20:.1f} MiB, per stage [{peaks}] MiB"
            if whole is not None
            else f"predicted peak per stage [{peaks}] MiB"
        )
        return (
            f"checkpoint=auto under {self.budget / 2**20:.1f} MiB per device: "
            f"checkpoint={[m.name for m in self.choice.modes]}, chunks={self.choice.chunks}, "
            f"balance={list(self.choice.balance)}; {peak}, "
            f"step {p.step_time_s * 1e3:.1f} ms ({p.schedule} schedule)"
        )


def first_microbatch(batch: Any, chunks: int) -> Any:
    """The first of ``chunks`` micro-batches of ``batch`` (tensors cut along dimension 0)."""
    if isinstance(batch, Tensor):
        return batch.chunk(chunks)[0]
    if isinstance(batch, (tuple, list)):
        return type(batch)(first_microbatch(b, chunks) for b in batch)
    return batch


def _batch_size(batch: Any) -> int:
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, Tensor) and t.dim() > 0]
    return int(leaves[0].shape[0]) if leaves else 1


def chunk_candidates(batch_size: int, configured: int) -> List[int]:
    """Chunk counts that cut the batch evenly: powers of two, the configured count, the batch size."""
    counts = {configured} | {2**k for k in range(batch_size.bit_length()) if 2**k <= batch_size}
    return sorted(c for c in counts if batch_size % c == 0)


def balance_candidates(layers: int, stages: int, around: Sequence[int]) -> List[Tuple[int, ...]]:
    """Every balance of ``layers`` into ``stages`` non-empty stages, or, when they are more than
    :data:`MAX_BALANCES`, those whose every cut lies within two layers of ``around``'s."""
    cut_sets: Iterable[Tuple[int, ...]]
    if _compositions(layers, stages) <= MAX_BALANCES:
        cut_sets = itertools.combinations(range(1, layers), stages - 1)
    else:
        around_cuts = list(itertools.accumulate(around))[:-1]
        cut_sets = itertools.product(*[range(c - 2, c + 3) for c in around_cuts])
    out = []
    for cuts in cut_sets:
        edges = (0, *cuts, layers)
        sizes = tuple(b - a for a, b in itertools.pairwise(edges))
        if all(s >= 1 for s in sizes):
            out.append(sizes)
    return out


def _compositions(n: int, k: int) -> int:
    from math import comb

    return comb(n - 1, k - 1)


def resolve_auto(
    settings: PipeSettings,
    sequential: nn.Sequential,
    *,
    devices: Sequence[torch.device],
    batch: Any,
    target: Any = None,
    loss_fn: Optional[Callable[[Tensor, Any], Tensor]] = None,
    accumulating: bool = False,
    profiles: Optional[Mapping[int, ModelProfile]] = None,
) -> AutoPlan:
    """Chooses the modes (and chunks and balance, as ``settings.memory_search`` asks) for
    ``checkpoint="auto"``, and returns the settings with them written in. ``batch``: one batch
    of the pipeline's input (the whole batch; it is cut into micro-batches here).

    ``profiles``: the profile of one micro-batch for each candidate chunk count, to choose from
    instead of profiling (the same profiles give the same choice; :attr:`AutoPlan.profiles`
    holds those a choice was made from). The engine says which op order the memory model walks,
    which chunk counts it runs and whether its stages share a device's budget
    (:class:`~pipeckpt.engines.base.Engine`)."""
    assert settings.memory_budget is not None  # PipeSettings requires it with checkpoint="auto"
    engine = engine_class(settings.engine)
    with engine.planning():
        engine.check_settings(settings)
        budget = parse_bytes(settings.memory_budget)
        search = set(settings.memory_search or ["modes"])
        schedule = engine.memory_schedule(settings)
        # The starting balance by parameters: profiled balances need a device pass of their own.
        start = replace(
            settings, checkpoint="never", balance_by="params", memory_budget=None, memory_search=None
        )
        base = make_plan(sequential, start, devices)
        size = _batch_size(batch)
        chunk_options = chunk_candidates(size, settings.chunks) if "chunks" in search else [settings.chunks]
        chunk_options = engine.auto_chunks(settings, chunk_options)
        given = dict(profiles or {})
        profiled: Dict[int, ModelProfile] = {
            c: given[c]
            if c in given
            else profile(
                sequential,
                first_microbatch(batch, c),
                loss_fn=loss_fn,
                target=first_microbatch(target, c) if target is not None else None,
                rounds=2,
            )
            for c in chunk_options
        }
        layers = len(sequential)
        balances = balance_candidates(layers, base.stages, base.balance) if "balance" in search else None
        choice = choose(
            profiled,
            budget,
            balance=base.balance,
            chunks=chunk_options,
            optimizer=settings.memory_optimizer,
            schedule=schedule,
            modes=DEFAULT_MODES,
            balances=balances,
            accumulating=accumulating,
            shared_device=engine.shares_device(base),
        )
    chosen = replace(
        settings,
        checkpoint=choice.modes,  # kept by name; PipeSettings.modes holds these objects
        chunks=choice.chunks,
        balance=list(choice.balance),
        stages=None,
        memory_budget=None,
        memory_search=None,
    )
    return AutoPlan(settings=chosen, choice=choice, budget=budget, profiles=profiled)


def resolve_for(
    settings: PipeSettings, module: Any, trainer: Any, devices: Optional[Sequence[torch.device]]
) -> AutoPlan:
    """:func:`resolve_auto` for the module a Trainer fits, on a batch of :func:`sample_batch`."""
    batch, target, loss_fn = sample_batch(module, getattr(trainer, "datamodule", None))
    return resolve_auto(
        settings,
        pipelined_sequential(module),
        devices=devices or [torch.device("cpu")],
        batch=batch,
        target=target,
        loss_fn=loss_fn,
        accumulating=trainer.accumulate_grad_batches > 1,
    )


def sample_batch(module: Any, datamodule: Any) -> Tuple[Any, Any, Optional[Callable[[Tensor, Any], Tensor]]]:
    """(pipeline input batch, target, loss) for profiling: the module's ``example_input_array``,
    else the datamodule's first training batch (see the module docstring)."""
    loss_fn = getattr(module, "pipeline_loss", None)
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return example, None, None
    if datamodule is None:
        raise config_error(
            f"checkpoint='auto' for {type(module).__name__} without a datamodule",
            "auto profiles one batch of the pipeline's input before training",
            "set example_input_array on the module (a batch of the pipeline's input), or pass a datamodule",
        )
    batch = next(iter(datamodule.train_dataloader()))
    if isinstance(batch, (tuple, list)) and len(batch) >= 1:
        target = batch[1] if len(batch) > 1 and callable(loss_fn) else None
        return batch[0], target, loss_fn if target is not None else None
    return batch, None, None
