"""``python -m pipeckpt.plan <hydra overrides>``: each stage's memory and time, before any training.

Why a command: whether a plan fits is the first question of a run and the slowest to answer by
trying. It composes ``conf/`` as ``train.py`` does (the same overrides), builds the strategy's
:class:`~pipeckpt.settings.PipeSettings`, the model and one batch, profiles one micro-batch
(:func:`pipeckpt.memory.profile.profile`) and prints the memory model's prediction per stage
(:data:`USAGE`: its own ``memory.*`` options, and examples). The model is built as a fit builds it
(:mod:`pipeckpt.plan_model`), the per-rank table of a sharded layout is :mod:`pipeckpt.plan_ranks`'s,
the table and picture of one device per stage :mod:`pipeckpt.plan_table`'s.
"""

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig

from pipeckpt._errors import PipeckptConfigError, config_error
from pipeckpt.app.checks import check_config
from pipeckpt.app.config import register
from pipeckpt.engines import engine_class
from pipeckpt.memory.auto import choose, parse_bytes
from pipeckpt.memory.budget import first_microbatch, resolve_auto
from pipeckpt.memory.machine import fake_or_real
from pipeckpt.memory.precision import forward_context
from pipeckpt.memory.predict import Prediction, predict
from pipeckpt.memory.profile import profile
from pipeckpt.memory.rank_peak import RankTable, format_ranks
from pipeckpt.memory.sharding import Layout
from pipeckpt.memory.timing import for_compile
from pipeckpt.plan_hand import check_layout
from pipeckpt.plan_layout import Answer, search_config
from pipeckpt.plan_model import Built, batch, build, built, plannable
from pipeckpt.plan_model import loss as _loss  # noqa: F401  (the loss the tests profile with)
from pipeckpt.plan_pick import given_layout, given_modes
from pipeckpt.plan_ranks import rank_run, takes_tensor_parallel
from pipeckpt.plan_settings import strategy_settings
from pipeckpt.plan_table import COLUMNS, draw, format_prediction, mib
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.partition import plan as make_plan

__all__ = ["main", "MemoryOptions", "format_prediction", "draw", "COLUMNS"]

CONF = Path(__file__).resolve().parents[1] / "conf"

USAGE = """usage: python -m pipeckpt.plan [HYDRA OVERRIDES ...] [memory.OPTION=VALUE ...]

Composes conf/ as train.py does and prints each stage's predicted memory and time.
A model built in configure_model (model=hf) is built as a fit builds it; model.path may name a
directory holding config.json alone (only shapes are read).

  python -m pipeckpt.plan model=mlp strategy.stages=3 ckpt=always
  python -m pipeckpt.plan strategy.chunks=8 memory.budget=2GiB            # + PNG, + auto choice
  python -m pipeckpt.plan ckpt=auto memory.budget=200MiB memory.search=[modes,chunks]
  python -m pipeckpt.plan model.size=small memory.fake=true memory.dtype=bfloat16
  python -m pipeckpt.plan model=llama3 model.size=8B model.seq_len=8192 strategy.stages=2 \
      strategy.chunks=8 data.batch_size=8 ckpt=selective trainer.precision=bf16-mixed \
      memory.fake=true memory.fsdp=4                                    # one rank's table
  python -m pipeckpt.plan model=gpt strategy.engine=distributed trainer.devices=4 \
      strategy.layout=auto cluster=local            # the top layouts on 4 processes, + PNG
  python -m pipeckpt.plan model=gpt strategy.engine=distributed trainer.devices=4 \
      strategy.stages=2 strategy.dp=2 cluster=local # this layout checked and predicted as the search does

The configs' memory.budget, memory.search and memory.optimizer are the strategy's memory_*
settings: with a budget the table marks each stage against it, prints the plan auto picks under
it and writes a PNG; under ckpt=auto the table is the chosen plan's. The command's own options:
  memory.schedule=NAME  the op order to predict (default: the engine's)
  memory.fake=BOOL      build the model on fake tensors (times from FLOPs); default: when its weights
                        and their gradients would not fit the memory available (said in one line)
  memory.available=SIZE the memory the default above compares with (default: the machine's, now)
  memory.dtype=NAME     the parameters' dtype, e.g. bfloat16
  memory.png=PATH       where the PNG goes (default memory_plan.png)
  memory.fsdp=N         FSDP2 shard degree in every stage: print one rank's table (trainer.precision
                        sets compute and master dtypes)
  memory.tp=N           tensor-parallel degree: the model is built as one rank's share (its
                        tensor_parallel argument, e.g. model=llama3), or its layers split by its
                        own plan (a pipeline_of model's config.base_model_tp_plan, e.g. model=hf)
  memory.reshard=BOOL   FSDP2 frees each block's gathered parameters after its forward (default false)
  memory.reduce_every=BOOL FSDP2 reduce-scatters the gradients in every micro-batch's backward
                        (strategy.reduce_every_microbatch; default false: once, after the last)
  memory.top=N          strategy.layout=auto: rank the N fastest layouts only, fitting none that a
                        step floor shows slower than them (the same N as a search of every layout,
                        in minutes where that takes an hour); the PNG draws those N
"""


@dataclass(frozen=True)
class MemoryOptions:
    budget: Optional[int] = None
    optimizer: str = "adam"
    schedule: Optional[str] = None
    fake: Optional[bool] = None  # None: on fake tensors when a real build would not fit
    dtype: Optional[str] = None
    png: Optional[str] = None
    fsdp: Optional[int] = None
    tp: Optional[int] = None
    reshard: bool = False
    reduce_every: bool = False
    available: Optional[int] = None
    top: Optional[int] = None  # strategy.layout=auto: the fastest ``top`` layouts only
    #: Why the model was built on fake tensors when the user did not ask (printed above the table).
    fake_reason: Optional[str] = None
    #: What the plan made of the model that the configs do not say (printed above the table).
    note: Optional[str] = None

    @property
    def sharded(self) -> bool:
        return self.fsdp is not None or self.tp is not None


#: ``memory.*`` keys the configs define (``conf/train.yaml``); the others are this command's own.
CONFIG_KEYS = ("budget", "search", "optimizer")


def split_options(argv: Sequence[str]) -> Tuple[MemoryOptions, List[str]]:
    """The command's own ``memory.*`` overrides (with or without ``+``) as options; the rest,
    the configs' ``memory.*`` keys included, for Hydra."""
    values: Dict[str, str] = {}
    rest = []
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if key.startswith("memory.") and sep and key[len("memory.") :] not in CONFIG_KEYS:
            values[key[len("memory.") :]] = value
        elif key.startswith("memory.") and sep:
            rest.append(arg.lstrip("+"))  # the configs define it: a plain override
        else:
            rest.append(arg)
    known = {"schedule", "fake", "dtype", "png", "fsdp", "tp", "reshard", "reduce_every", "available", "top"}
    known |= set(CONFIG_KEYS)
    unknown = sorted(set(values) - known)
    if unknown:
        raise config_error(
            f"memory.{unknown[0]}",
            f"is not an option of the plan command ({sorted(known)})",
            "drop or fix it",
        )
    return (
        MemoryOptions(
            schedule=values.get("schedule"),
            fake=values["fake"].lower() in ("1", "true", "yes") if "fake" in values else None,
            dtype=values.get("dtype"),
            png=values.get("png"),
            fsdp=_degree(values, "fsdp"),
            tp=_degree(values, "tp"),
            reshard=values.get("reshard", "false").lower() in ("1", "true", "yes"),
            reduce_every=values.get("reduce_every", "false").lower() in ("1", "true", "yes"),
            available=parse_bytes(values["available"], "memory.available") if "available" in values else None,
            top=_degree(values, "top", "a number of layouts"),
        ),
        rest,
    )


def _messages(error: BaseException) -> str:
    """``error``'s message and its causes', one after another, as Hydra prints a failed composition
    ("Error merging override ..." is followed by what was wrong with the value)."""
    lines = []
    cause: Optional[BaseException] = error
    while cause is not None:
        lines.append(str(cause).strip())
        cause = cause.__cause__
    return "\n".join(line for line in lines if line)


def _degree(values: Dict[str, str], key: str, what: str = "a degree") -> Optional[int]:
    if key not in values:
        return None
    if not values[key].isdigit() or int(values[key]) < 1:
        raise config_error(
            f"memory.{key}={values[key]}", f"{what} is a whole number, 1 or more", f"set memory.{key}=4"
        )
    return int(values[key])


def _batch(cfg: DictConfig) -> Tuple[Any, Any]:
    """The first batch of a model whose batches are (inputs, targets) pairs."""
    inputs, targets = batch(cfg)
    return inputs, targets


def run(argv: Sequence[str]) -> Tuple[Union[Prediction, RankTable, Answer], MemoryOptions, Optional[str]]:
    """Composes the config, profiles and predicts; returns the prediction, the options and the
    auto choice's line (when a budget is given)."""
    options, overrides = split_options(argv)
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            cfg = compose(config_name="train", overrides=list(overrides))
        except HydraException as error:  # an override Hydra cannot apply: its messages, as train.py's
            raise PipeckptConfigError(_messages(error)) from None
    cfg, note = plannable(cfg)
    options = replace(options, note=note)
    check_config(cfg)  # train.py's checks, before the data and the model are built
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if isinstance(cfg.strategy, DictConfig) and cfg.strategy.get("layout") == "auto":
        png, modes, pins = (
            options.png or "layout_frontier.png",
            given_modes(cfg, overrides),
            given_layout(cfg, overrides),
        )
        return search_config(cfg, png=png, top=options.top, modes=modes, pins=pins), options, None
    if options.top is not None:
        raise config_error(
            f"memory.top={options.top}",
            "it ranks the fastest layouts of a search, and strategy.layout is not auto",
            "add strategy.layout=auto (with cluster=NAME), or drop memory.top",
        )
    if any(o.lstrip("+").startswith("cluster=") for o in overrides):  # a layout given by hand, on it
        return check_layout(cfg), options, None
    torch.manual_seed(cfg.seed)
    settings, budget = strategy_settings(cfg)
    options = replace(options, budget=budget, optimizer=settings.memory_optimizer or options.optimizer)
    drawn = batch(cfg)
    with forward_context(cfg.trainer.precision, torch.device("cpu")):  # profiled as the step runs
        return _run(cfg, settings, options, drawn)


def _run(
    cfg: DictConfig, settings: PipeSettings, options: MemoryOptions, drawn: Any
) -> Tuple[Union[Prediction, RankTable], MemoryOptions, Optional[str]]:
    if options.sharded:
        table, options = _per_rank_run(cfg, settings, options, drawn)
        return table, options, None
    dtype = getattr(torch, options.dtype) if options.dtype else None
    default_dtype = torch.get_default_dtype()
    if dtype is not None and dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        options = _decided(cfg, options, {})
        with built(cfg, drawn, fake=bool(options.fake)) as b:
            prediction, choice = _predict(b, settings, options)
    finally:
        torch.set_default_dtype(default_dtype)
    return prediction, options, choice


def _decided(cfg: DictConfig, options: MemoryOptions, extra: Dict[str, Any]) -> MemoryOptions:
    """``options`` with memory.fake decided (the model's meta build, ``configure_model`` run, against
    the memory available) and the lines that say why printed with the table."""
    fake, reason = fake_or_real(options.fake, lambda: build(cfg, extra), available=options.available)
    return replace(options, fake=fake, fake_reason=reason)


def _on_cpu(cfg: DictConfig) -> bool:
    """Whether the configured run trains on CPU, where Lightning's process group is gloo's."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def _per_rank_run(
    cfg: DictConfig, settings: PipeSettings, options: MemoryOptions, drawn: Any
) -> Tuple[RankTable, MemoryOptions]:
    """One rank's table (:mod:`pipeckpt.plan_ranks`), built in the compute dtype; and the options,
    fake decided."""
    layout = Layout(
        fsdp=options.fsdp or 1,
        tp=options.tp or 1,
        reshard_after_forward=options.reshard,
        reduce_every_microbatch=options.reduce_every,
        precision=str(cfg.trainer.precision),
        sequence_parallel=bool(settings.sequence_parallel) and (options.tp or 1) > 1,
        gloo=_on_cpu(cfg),
    )
    if settings.modes == "auto":
        raise config_error(
            "ckpt=auto with memory.fsdp/tp", "the per-rank table is for given modes", "name modes"
        )
    extra = {"tensor_parallel": layout.tp} if layout.tp > 1 and takes_tensor_parallel(cfg) else {}
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(layout.compute_dtype)
    try:
        options = _decided(cfg, options, extra)
        table, note = rank_run(
            cfg,
            settings,
            layout,
            drawn,
            fake=bool(options.fake),
            optimizer=options.optimizer,
            schedule=options.schedule,
        )
    finally:
        torch.set_default_dtype(default_dtype)
    if note is not None:
        options = replace(options, note="\n".join(n for n in (options.note, note) if n))
    return table, options


def _predict(b: Built, settings: PipeSettings, options: MemoryOptions) -> Tuple[Prediction, Optional[str]]:
    cpu = [torch.device("cpu")]
    sequential, inputs, targets, fake = b.sequential, b.inputs, b.targets, bool(options.fake)
    if settings.modes == "auto":
        auto = resolve_auto(
            settings, sequential, devices=cpu, batch=inputs, target=targets, loss_fn=b.loss_fn, fake=fake
        )
        return auto.choice.prediction, auto.describe()
    stage_plan = make_plan(sequential, settings, cpu, sample=inputs)
    schedule = options.schedule or engine_class(settings.engine).memory_schedule(settings)
    chunks = settings.chunks
    micro_targets = first_microbatch(targets, chunks) if targets is not None else None
    fitted = profile(  # predict's schedules never split a backward
        sequential,
        first_microbatch(inputs, chunks),
        loss_fn=b.loss_fn,
        target=micro_targets,
        fake=fake,
        split_backward=False,
    )
    fitted = for_compile(fitted, settings.compile is not False)  # compiled selective: no SAC host cost
    prediction = predict(fitted, stage_plan, chunks=chunks, optimizer=options.optimizer, schedule=schedule)
    choice = None
    if options.budget is not None:
        try:
            picked = choose(
                fitted,
                options.budget,
                balance=stage_plan.balance,
                chunks=chunks,
                optimizer=options.optimizer,
                schedule=schedule,
            )
            choice = (
                f"auto under {mib(options.budget)}: checkpoint={[m.name for m in picked.modes]}, "
                f"peak {mib(picked.prediction.peak)}, step {picked.prediction.step_time_s * 1e3:.1f} ms"
            )
        except PipeckptConfigError as error:
            choice = f"auto: {error}"
    return prediction, choice


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE, end="", flush=True)
        return 0
    try:
        prediction, options, choice = run(argv)
    except PipeckptConfigError as error:
        print(f"Configuration error: {error}", file=sys.stderr, flush=True)
        return 1
    for line in (options.note, options.fake_reason):
        if line is not None:
            print(line, flush=True)
    if isinstance(prediction, RankTable):
        print(format_ranks(prediction), flush=True)
        return 0
    if isinstance(prediction, Answer):
        print(prediction.text(), flush=True)
        if prediction.searched.considered > 1:  # a search (one layout checked draws nothing)
            print(f"wrote {options.png or 'layout_frontier.png'}", flush=True)
        return 0
    print(format_prediction(prediction, options.budget), flush=True)
    if choice is not None:
        print(choice, flush=True)
    png = options.png or ("memory_plan.png" if options.budget is not None else None)
    if png is not None:
        draw(prediction, png, options.budget)
        print(f"wrote {png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
