"""``python -m pipeckpt.plan <hydra overrides>``: each stage's memory and time, before any training.

Why a command: whether a plan fits is the first question of a run and the slowest to answer by
trying. It composes ``conf/`` as ``train.py`` does (the same overrides), builds the strategy's
:class:`~pipeckpt.settings.PipeSettings`, the model and one batch, profiles one micro-batch
(:func:`pipeckpt.memory.profile.profile`) and prints the memory model's prediction per stage
(:data:`USAGE`: its own ``memory.*`` options, and examples).
"""

import sys
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeckpt._errors import PipeckptConfigError, config_error
from pipeckpt.app.checks import check_config
from pipeckpt.app.config import register
from pipeckpt.boundaries.contract import pipelined_sequential
from pipeckpt.engines import engine_class
from pipeckpt.memory.auto import choose, parse_bytes
from pipeckpt.memory.budget import resolve_auto
from pipeckpt.memory.machine import fake_or_real
from pipeckpt.memory.precision import forward_context
from pipeckpt.memory.predict import Prediction, predict
from pipeckpt.memory.profile import fake_mode, profile
from pipeckpt.memory.repeated import repeat_layer, shortened
from pipeckpt.memory.sharding import Layout, RankTable, format_ranks, rank_table
from pipeckpt.memory.timing import for_compile
from pipeckpt.settings import PipeSettings, check_names
from pipeckpt.sizes import MiB
from pipeckpt.stages.partition import plan as make_plan

__all__ = ["main", "MemoryOptions", "format_prediction", "draw"]

CONF = Path(__file__).resolve().parents[1] / "conf"

USAGE = """usage: python -m pipeckpt.plan [HYDRA OVERRIDES ...] [memory.OPTION=VALUE ...]

Composes conf/ as train.py does and prints each stage's predicted memory and time.

  python -m pipeckpt.plan model=mlp strategy.stages=3 ckpt=always
  python -m pipeckpt.plan strategy.chunks=8 memory.budget=2GiB            # + PNG, + auto choice
  python -m pipeckpt.plan ckpt=auto memory.budget=200MiB memory.search=[modes,chunks]
  python -m pipeckpt.plan model.size=small memory.fake=true memory.dtype=bfloat16
  python -m pipeckpt.plan model=llama3 model.size=8B model.seq_len=8192 strategy.stages=2 \
      strategy.chunks=8 data.batch_size=8 ckpt=selective trainer.precision=bf16-mixed \
      memory.fake=true memory.fsdp=4                                    # one rank's table

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
                        tensor_parallel argument, e.g. model=llama3)
  memory.reshard=BOOL   FSDP2 frees each block's gathered parameters after its forward (default false)
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
    available: Optional[int] = None
    #: Why the model was built on fake tensors when the user did not ask (printed above the table).
    fake_reason: Optional[str] = None

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
    known = {"schedule", "fake", "dtype", "png", "fsdp", "tp", "reshard", "available", *CONFIG_KEYS}
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
            available=parse_bytes(values["available"]) if "available" in values else None,
        ),
        rest,
    )


def _degree(values: Dict[str, str], key: str) -> Optional[int]:
    if key not in values:
        return None
    if not values[key].isdigit() or int(values[key]) < 1:
        raise config_error(
            f"memory.{key}={values[key]}", "a degree is a whole number, 1 or more", f"set memory.{key}=4"
        )
    return int(values[key])


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (the bundled models' loss, classifiers and GPT alike)."""
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def _batch(cfg: DictConfig) -> Tuple[Any, Any]:
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    inputs, targets = next(iter(datamodule.train_dataloader()))
    return inputs, targets


def run(argv: Sequence[str]) -> Tuple[Union[Prediction, RankTable], MemoryOptions, Optional[str]]:
    """Composes the config, profiles and predicts; returns the prediction, the options and the
    auto choice's line (when a budget is given)."""
    options, overrides = split_options(argv)
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    check_config(cfg)  # train.py's checks, before the data and the model are built
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    settings, budget = _settings(cfg)
    options = replace(options, budget=budget, optimizer=settings.memory_optimizer or options.optimizer)
    inputs, targets = _batch(cfg)
    with forward_context(cfg.trainer.precision, torch.device("cpu")):  # profiled as the step runs
        return _run(cfg, settings, options, inputs, targets)


def _run(
    cfg: DictConfig, settings: PipeSettings, options: MemoryOptions, inputs: Any, targets: Any
) -> Tuple[Union[Prediction, RankTable], MemoryOptions, Optional[str]]:
    if options.sharded:
        table, options = _per_rank_run(cfg, settings, options, inputs, targets)
        return table, options, None
    dtype = getattr(torch, options.dtype) if options.dtype else None
    default_dtype = torch.get_default_dtype()
    if dtype is not None and dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        options = _decided(options, lambda: instantiate(cfg.model))
        if options.fake:
            with fake_mode():
                module = instantiate(cfg.model)
                sequential = pipelined_sequential(module)
                prediction, choice = _predict(sequential, inputs, targets, settings, options)
        else:
            module = instantiate(cfg.model)
            sequential = pipelined_sequential(module)
            prediction, choice = _predict(sequential, inputs, targets, settings, options)
    finally:
        torch.set_default_dtype(default_dtype)
    return prediction, options, choice


def _decided(options: MemoryOptions, build: Callable[[], torch.nn.Module]) -> MemoryOptions:
    fake, reason = fake_or_real(options.fake, build, available=options.available)
    return replace(options, fake=fake, fake_reason=reason)


def _settings(cfg: DictConfig) -> Tuple[PipeSettings, Optional[int]]:
    """The strategy's settings as ``train.py`` builds them, and the budget to mark the stages against."""
    container = OmegaConf.to_container(cfg.strategy, resolve=True)
    assert isinstance(container, dict)
    given: Dict[str, Any] = {str(k): v for k, v in container.items()}
    if given.pop("_target_", None) is None:
        raise config_error(
            f"strategy={given.get('name')!r}",
            "the plan command models the pipe strategy",
            "use strategy=pipe",
        )
    budget = given.get("memory_budget")
    if given.get("checkpoint") != "auto":  # a budget here only marks the stages against it
        given.update(memory_budget=None, memory_search=None)
    check_names(given, "strategy")
    settings = PipeSettings(**given)
    engine_class(settings.engine).check_settings(settings)
    return settings, parse_bytes(budget) if budget is not None else None


def _per_rank_run(
    cfg: DictConfig, settings: PipeSettings, options: MemoryOptions, inputs: Any, targets: Any
) -> Tuple[RankTable, MemoryOptions]:
    """One rank's table: the model built as one tensor-parallel rank's share in the compute dtype,
    profiled (a run of identical blocks once, on fake tensors), its stages' state sharded; and the
    options, fake decided."""
    layout = Layout(
        fsdp=options.fsdp or 1,
        tp=options.tp or 1,
        reshard_after_forward=options.reshard,
        precision=str(cfg.trainer.precision),
    )
    if settings.modes == "auto":
        raise config_error(
            "ckpt=auto with memory.fsdp/tp", "the per-rank table is for given modes", "name modes"
        )
    extra = {"tensor_parallel": layout.tp} if layout.tp > 1 else {}
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(layout.compute_dtype)
    try:
        options = _decided(options, lambda: instantiate(cfg.model, **extra))
        with fake_mode() if options.fake else nullcontext():
            try:
                module = instantiate(cfg.model, **extra)
            except InstantiationException as error:
                if isinstance(error.__cause__, PipeckptConfigError):
                    raise error.__cause__ from None
                raise config_error(
                    f"memory.tp={layout.tp} with model._target_={cfg.model._target_}",
                    "the model is built as one tensor-parallel rank's share by its tensor_parallel "
                    f"argument ({error})",
                    "use a model that takes it (model=llama3) or drop memory.tp",
                ) from None
            sequential = pipelined_sequential(module)
            stage_plan = make_plan(sequential, settings, [torch.device("cpu")], sample=inputs)
            short, index, count = shortened(sequential) if options.fake else (sequential, 0, 1)
            chunks = settings.chunks
            fitted = profile(
                short,
                inputs.chunk(chunks)[0],
                loss_fn=_loss,
                target=targets.chunk(chunks)[0],
                fake=bool(options.fake),
            )
            fitted = repeat_layer(fitted, index, count) if count > 1 else fitted
            schedule = options.schedule or engine_class(settings.engine).memory_schedule(settings)
            prediction = predict(
                fitted, stage_plan, chunks=chunks, optimizer=options.optimizer, schedule=schedule
            )
            return rank_table(prediction, sequential, stage_plan.ranges, layout, options.optimizer), options
    finally:
        torch.set_default_dtype(default_dtype)


def _predict(
    sequential: torch.nn.Sequential,
    inputs: Any,
    targets: Any,
    settings: PipeSettings,
    options: MemoryOptions,
) -> Tuple[Prediction, Optional[str]]:
    cpu = [torch.device("cpu")]
    if settings.modes == "auto":
        auto = resolve_auto(settings, sequential, devices=cpu, batch=inputs, target=targets, loss_fn=_loss)
        return auto.choice.prediction, auto.describe()
    stage_plan = make_plan(sequential, settings, cpu, sample=inputs)
    schedule = options.schedule or engine_class(settings.engine).memory_schedule(settings)
    chunks = settings.chunks
    micro_inputs, micro_targets = inputs.chunk(chunks)[0], targets.chunk(chunks)[0]
    fitted = profile(sequential, micro_inputs, loss_fn=_loss, target=micro_targets, fake=bool(options.fake))
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
                f"auto under {_mib(options.budget)}: checkpoint={[m.name for m in picked.modes]}, "
                f"peak {_mib(picked.prediction.peak)}, step {picked.prediction.step_time_s * 1e3:.1f} ms"
            )
        except PipeckptConfigError as error:
            choice = f"auto: {error}"
    return prediction, choice


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


COLUMNS = ("params", "grads", "optimizer", "activations", "boundary", "working")


def format_prediction(prediction: Prediction, budget: Optional[int] = None) -> str:
    """One row per stage (MiB, and milliseconds of the stage's own compute per step)."""
    header = (
        f"{'stage':>5} {'layers':>7} {'mode':>11} "
        + " ".join(f"{c:>11}" for c in COLUMNS)
        + f" {'peak':>9} {'in-flight':>9} {'recomp':>6} {'time ms':>8}  peak at"
    )
    lines = [
        f"schedule {prediction.schedule} ({prediction.order_source}), chunks {prediction.chunks}; "
        "MiB per stage",
        header,
    ]
    for s in prediction.stages:
        mark = "" if budget is None else ("  fits" if s.peak <= budget else "  OVER BUDGET")
        lines.append(
            f"{s.stage:>5} {f'{s.layers[0]}-{s.layers[1] - 1}':>7} {s.mode:>11} "
            + " ".join(f"{getattr(s, c) / MiB:>11.2f}" for c in COLUMNS)
            + f" {s.peak / MiB:>9.2f} {s.in_flight:>9} {s.recomputed:>6} {s.time_s * 1e3:>8.1f}"
            + f"  {s.peak_at}{mark}"
        )
    lines.append(f"predicted step time: {prediction.step_time_s * 1e3:.1f} ms (one device per stage)")
    return "\n".join(lines)


def draw(prediction: Prediction, path: str, budget: Optional[int] = None) -> None:
    """Stacked bars per stage (the peak's parts), the budget as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(prediction.stages), 4))
    x = [s.stage for s in prediction.stages]
    bottom = [0.0] * len(x)
    for column in COLUMNS:
        values = [getattr(s, column) / MiB for s in prediction.stages]
        ax.bar(x, values, bottom=bottom, label=column)
        bottom = [b + v for b, v in zip(bottom, values)]
    if budget is not None:
        ax.axhline(budget / MiB, color="black", linestyle="--", label=f"budget {_mib(budget)}")
    ax.set_xticks(x, [f"{s.stage}\n{s.mode}" for s in prediction.stages])
    ax.set_xlabel("stage")
    ax.set_ylabel("MiB at the stage's peak")
    ax.set_title(f"predicted memory per stage ({prediction.schedule}, chunks {prediction.chunks})")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    if options.fake_reason is not None:
        print(options.fake_reason, flush=True)
    if isinstance(prediction, RankTable):
        print(format_ranks(prediction), flush=True)
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
