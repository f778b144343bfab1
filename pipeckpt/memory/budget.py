"""``checkpoint="auto"`` under ``memory_budget``: the plan chosen before the stages are built.

Why not in an engine: the choice needs the model, one batch and the settings, nothing an engine
builds, and once made it is ordinary settings, so every engine builds what it would have built
from the same settings written by hand. Where the batch comes from: docs/DESIGN.md, memory/budget.
"""

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from pipeckpt._compat import configured_optimizers, fit_train_loader, tree_flatten
from pipeckpt._errors import PipeckptConfigError, config_error
from pipeckpt.boundaries.contract import pipelined_sequential
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.engines import engine_class
from pipeckpt.engines.base import Engine
from pipeckpt.memory.auto import DEFAULT_MODES, Choice, choose, parse_bytes
from pipeckpt.memory.fake_weights import fake_weights
from pipeckpt.memory.optimizer_state import optimizer_state_bytes
from pipeckpt.memory.profile import ModelProfile, profile
from pipeckpt.memory.rooted import RootInput, root_microbatch
from pipeckpt.memory.sharding import Layout, stage_rank_states
from pipeckpt.memory.timing import for_compile
from pipeckpt.memory.tp_local import one_rank_profile
from pipeckpt.memory.vocab_share import split_profiles
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.gradients import zeroes_its_own_way
from pipeckpt.stages.materialize import on_meta
from pipeckpt.stages.partition import plan as make_plan

__all__ = [
    "AutoPlan",
    "resolve_auto",
    "resolve_for",
    "sample_batch",
    "chunk_candidates",
    "balance_candidates",
    "first_microbatch",
    "fitted_optimizer",
    "first_call",
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
    #: How the stages were counted sharded over their ranks (None: each stage whole on its device).
    layout: Optional[Layout] = None

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
        lay = self.layout
        counted = (
            f" (counted per rank: fsdp={lay.fsdp}, tp={lay.tp}, reshard_after_forward="
            f"{lay.reshard_after_forward}, {lay.precision})"
            if lay is not None
            else ""
        )
        return (
            f"checkpoint=auto under {self.budget / 2**20:.1f} MiB per device{counted}: "
            f"checkpoint={[m.name for m in self.choice.modes]}, chunks={self.choice.chunks}, "
            f"balance={list(self.choice.balance)}; {peak}, "
            f"step {p.step_time_s * 1e3:.1f} ms ({p.schedule} schedule)"
        )


def first_microbatch(batch: Any, chunks: int) -> Any:
    """The first of ``chunks`` micro-batches of ``batch`` (tensors cut along dimension 0; a
    ``pipeline_of`` model's arguments as its pipeline cuts them)."""
    if isinstance(batch, RootInput):
        return root_microbatch(batch, chunks)
    if isinstance(batch, Tensor):
        return batch.chunk(chunks)[0]
    if isinstance(batch, (tuple, list)):
        return type(batch)(first_microbatch(b, chunks) for b in batch)
    return batch


def _batch_size(batch: Any) -> int:
    if isinstance(batch, RootInput):
        batch = (batch.args, batch.kwargs)
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
    optimizer: Union[str, torch.optim.Optimizer, None] = None,
    stale_grads: bool = False,
    layout: Optional[Layout] = None,
    fake: bool = False,
) -> AutoPlan:
    """Chooses the modes (and chunks and balance, as ``settings.memory_search`` asks) for
    ``checkpoint="auto"``, and returns the settings with them written in. ``batch``: one batch
    of the pipeline's input (the whole batch; it is cut into micro-batches here): for a
    ``pipeline_of`` model the arguments of its ``forward`` (:class:`~pipeckpt.memory.rooted.RootInput`).
    ``optimizer``: whose state to count (a name or the optimizer) unless ``settings.memory_optimizer``
    names one; Adam's when neither does. ``stale_grads``: the previous step's gradients live until
    the backward starts, as under a Trainer (local engine).

    ``profiles``: the profile of one micro-batch for each candidate chunk count, to choose from
    instead of profiling (the same profiles give the same choice; :attr:`AutoPlan.profiles`
    holds those a choice was made from). ``layout``: how each stage's parameters, gradients and
    optimizer state are spread over its ranks (FSDP2, tensor parallel, precision); each stage's peak
    is then one rank's (:mod:`pipeckpt.memory.sharding`). The engine says which op order the
    memory model walks, which chunk counts it runs and whether its stages share a device's budget
    (:class:`~pipeckpt.engines.base.Engine`). ``fake``: ``sequential`` holds fake tensors
    (:mod:`pipeckpt.memory.fake_weights`), profiled without allocating, times from FLOP counts."""
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
            else _one_rank(
                sequential,
                layout,
                lambda c=c: profile(  # type: ignore[misc]
                    sequential,
                    first_microbatch(batch, c),
                    loss_fn=loss_fn,
                    target=first_microbatch(target, c) if target is not None else None,
                    rounds=2,
                    fake=fake,
                    split_backward=False,  # auto's schedules never split a backward
                ),
            )
            for c in chunk_options
        }
        profiled = {c: for_compile(p, settings.compile is not False) for c, p in profiled.items()}
        layers = len(sequential)
        balances = balance_candidates(layers, base.stages, base.balance) if "balance" in search else None
        counted = settings.memory_optimizer or optimizer or "adam"
        choice = choose(
            # a head the layout splits over the vocabulary: each rank's share of its logits
            profiled if layout is None else split_profiles(profiled, layout.tp, layout.tp_plan),
            budget,
            balance=base.balance,
            chunks=chunk_options,
            optimizer=counted,
            schedule=schedule,
            modes=DEFAULT_MODES,
            balances=balances,
            accumulating=accumulating,
            shared_device=engine.shares_device(base),
            # Only the local engine's step keeps the Trainer's order (zero_grad after the forward).
            stale_grads=stale_grads and schedule == "local",
            rank_states=None
            if layout is None
            else stage_rank_states(sequential, layout, counted, next(iter(profiled.values())).outside_params),
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
    return AutoPlan(settings=chosen, choice=choice, budget=budget, profiles=profiled, layout=layout)


def _one_rank(
    sequential: nn.Sequential, layout: Optional[Layout], profiled: Callable[[], ModelProfile]
) -> ModelProfile:
    """``profiled()`` with the layers cut to one tensor-parallel rank by ``layout``'s plan, and its
    part of the sequence under sequence parallelism, as the layout search profiles them
    (:func:`~pipeckpt.memory.tp_local.one_rank_profile`; the model is left as it was): profiled
    whole, every activation between a colwise and a rowwise projection counted ``tp`` times."""
    if layout is None or layout.tp <= 1 or not layout.tp_plan:
        return profiled()
    plan = dict(layout.tp_plan)
    return one_rank_profile(sequential, plan, layout.tp, profiled, sequence=layout.sequence_parallel)


def resolve_for(
    settings: PipeSettings,
    module: Any,
    trainer: Any,
    devices: Optional[Sequence[torch.device]],
    engine: Optional[Engine] = None,
) -> AutoPlan:
    """:func:`resolve_auto` for the module a Trainer fits: on a batch of :func:`sample_batch` from
    the fit's training loader, counting the state of the module's own optimizer, each stage as
    ``engine`` (the strategy's, its world known) spreads it over ranks (:meth:`Engine.memory_layout`).
    A module still on the meta device (built there, each process to make only its own stages real)
    is profiled on fake tensors of its shapes (:func:`~pipeckpt.memory.fake_weights.fake_weights`)."""
    devices = devices or [torch.device("cpu")]
    loader = fit_train_loader(trainer)
    if not on_meta(module):
        return _resolve_for(settings, module, trainer, loader, devices, engine, fake=False)
    if loader is not None and getattr(module, "example_input_array", None) is None:
        loader = [next(iter(loader))]  # drawn outside the fake mode: a loader's seed is a real draw
    with fake_weights(module, devices[0]):
        return _resolve_for(settings, module, trainer, loader, devices, engine, fake=True)


def _resolve_for(
    settings: PipeSettings,
    module: Any,
    trainer: Any,
    loader: Any,
    devices: Sequence[torch.device],
    engine: Optional[Engine],
    *,
    fake: bool,
) -> AutoPlan:
    sequential = pipelined_sequential(module)
    spread = engine.memory_layout(sequential) if engine is not None else {}
    batch, target, loss_fn = sample_batch(module, loader, sequential)
    with trainer.precision_plugin.forward_context():  # profiled as the step runs
        return resolve_auto(
            settings,
            sequential,
            devices=devices,
            fake=fake,
            batch=batch,
            target=target,
            loss_fn=loss_fn,
            accumulating=trainer.accumulate_grad_batches > 1,
            optimizer=None if settings.memory_optimizer else fitted_optimizer(module),
            # Lightning zeroes the gradients after training_step: the last step's live through its
            # forward where the engine cannot drop them first (engines/local/engine.py,
            # drop_stale_gradients): a module zeroing them its own way.
            stale_grads=bool(getattr(module, "automatic_optimization", True)) and zeroes_its_own_way(module),
            layout=Layout(**spread) if spread else None,
        )


def fitted_optimizer(module: Any) -> Union[str, torch.optim.Optimizer]:
    """The optimizer ``module.configure_optimizers()`` returns, whose state the plan counts; of
    several, the one that keeps the most state per parameter."""
    found = configured_optimizers(module.configure_optimizers())
    if not found:
        return "sgd"  # no optimizer: no state
    named = []
    for optimizer in found:
        try:
            named.append((optimizer_state_bytes(optimizer, 1 << 20, 0), optimizer))
        except PipeckptConfigError:
            raise config_error(
                f"checkpoint='auto' with {type(optimizer).__name__} from configure_optimizers()",
                "the memory model counts the state of SGD (with or without momentum), Adam and AdamW",
                "set memory_optimizer to the one whose state is closest (sgd, momentum, adam or adamw)",
            ) from None
    return max(named, key=lambda pair: pair[0])[1]


def sample_batch(
    module: Any, loader: Any, sequential: Optional[nn.Module] = None
) -> Tuple[Any, Any, Optional[Callable[[Tensor, Any], Tensor]]]:
    """(pipeline input batch, target, loss) for profiling: from the module's ``example_input_array``,
    else from the first batch of ``loader`` (the fit's training loader).

    For a ``pipeline_of`` model (``sequential`` a :class:`~pipeckpt.boundaries.pipeline_of.ModulePipeline`)
    the pipeline's input is the arguments its ``forward`` is called with: ``example_input_array`` as
    Lightning passes it to ``forward``, else those of the first call ``training_step`` makes on the
    loader's first batch (the step stops there). A Sequential's is the batch's first element, its
    target the second when the module has a ``pipeline_loss``."""
    loss_fn = getattr(module, "pipeline_loss", None)
    example = getattr(module, "example_input_array", None)
    rooted = isinstance(sequential, ModulePipeline)
    if example is not None:
        return (RootInput.of(example) if rooted else example), None, None
    if loader is None:
        raise config_error(
            f"checkpoint='auto' for {type(module).__name__} without training data",
            "auto profiles one batch of the pipeline's input before training",
            "pass a train loader or datamodule to fit(), or set example_input_array on the module",
        )
    batch = next(iter(loader))
    if rooted:
        assert isinstance(sequential, ModulePipeline)
        return first_call(module, sequential, batch), None, None
    if isinstance(batch, (tuple, list)) and len(batch) >= 1:
        target = batch[1] if len(batch) > 1 and callable(loss_fn) else None
        return batch[0], target, loss_fn if target is not None else None
    return batch, None, None


class _Called(Exception):
    """Stops ``training_step`` at the model's call, holding its arguments."""

    def __init__(self, call: RootInput) -> None:
        super().__init__("the pipelined model was called")
        self.call = call


def first_call(module: Any, spec: ModulePipeline, batch: Any) -> RootInput:
    """The arguments ``module.training_step(batch, 0)`` first calls ``spec``'s model with: the
    step runs up to that call (under no gradient) and stops there."""
    root = spec.root

    def called(*args: Any, **kwargs: Any) -> Any:
        raise _Called(RootInput(tuple(args), dict(kwargs)))

    own = root.__dict__.get("forward")
    root.forward = called
    try:
        with torch.no_grad():
            module.training_step(batch, 0)
    except _Called as stop:
        return stop.call
    finally:
        if own is None:
            root.__dict__.pop("forward", None)
        else:
            root.forward = own
    raise config_error(
        f"checkpoint='auto' for {type(module).__name__}",
        f"profiling takes the pipeline's input from the call of {type(root).__name__} in training_step, "
        "and training_step made none on the first batch",
        "call the model passed to pipeline_of() in training_step, or set example_input_array to its input",
    )
