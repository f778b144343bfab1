"""``PipelineStrategy(layout="auto")`` in a script of the user's own: the layout searched when
``trainer.fit`` starts, before any process of the run is started, and trained by every process.

Why at the launch: the search needs the model, its first batch and the world; the strategy meets
the model in ``trainer.fit``, and the world's processes start right after (Lightning's launcher
runs the script again for every other local rank). So the launcher the strategy hands Lightning
searches first, in the launching process, and hands its pick to the processes it starts, as
``train.py strategy.layout=auto`` does (:func:`pipeckpt.plan_pick.agreed_pick`: under torchrun or
srun global rank 0 searches and the others take its pick through the run's store).

The batch: the training loader's batch is the step's global batch, whatever the pick; each of the
pick's replicas trains an equal share of it (every process reads the same batches). A step's
samples therefore do not depend on the layout searched, and a script's global batch is the one its
loader says, as on one device.
"""

import importlib
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from pipeckpt._compat import fit_arguments, relaunch
from pipeckpt._errors import config_error
from pipeckpt.engines import engine_class
from pipeckpt.settings import PipeSettings

__all__ = [
    "GIVEN",
    "LayoutSearch",
    "log_pick",
    "cut",
    "searched_later",
    "replica_share",
    "searching_launcher",
]

#: How the user asked for the search, as its lines and errors name it.
GIVEN = "PipelineStrategy(layout='auto')"

#: The search a script's strategy runs at its launch, by import path: the search sits above the
#: strategy (it builds the app's models and prices the engines' layouts), so the strategy names it
#: as the engine table names the engines, and imports it only when a fit asks for a layout.
SEARCH = "pipeckpt.plan_script:pick_for"


#: What ``checkpoint="auto"`` plans one layout's modes to: the search fits every layout to the
#: cluster's devices instead.
_BUDGET = ("memory_budget", "memory_search")


class LayoutSearch:
    """What ``layout="auto"`` keeps until the pick: the settings the script named (kept by the
    search, :class:`~pipeckpt.layout.pins.Pins`), the cluster, and then the pick."""

    def __init__(self, named: Mapping[str, Any], cluster: Any) -> None:
        self.named, self.cluster = dict(named), cluster
        self.pick: Optional[Dict[str, Any]] = None

    def modes(self) -> Optional[str]:
        """The mode every stage keeps where the script named one; None: the search chooses."""
        given = self.named.get("checkpoint")
        return None if given is None else str(given)


def searched_later(named: Mapping[str, Any], cluster: Any) -> Tuple[PipeSettings, Optional[LayoutSearch]]:
    """The strategy's settings until the pick (the layout ``"manual"`` as given: the engine runs
    nothing before it), and what the search keeps; every check before any work. ``checkpoint="auto"``
    under ``layout="auto"`` leaves each stage's mode to the search, as naming none does."""
    if named.get("layout") == "auto":
        _check_unbudgeted(named)
        if named.get("checkpoint") == "auto":
            named = {k: v for k, v in named.items() if k != "checkpoint"}
    settings = PipeSettings(**named)
    if settings.layout != "auto":
        if cluster is not None:
            raise config_error(
                f"cluster={cluster!r} with layout={settings.layout!r}",
                "the cluster describes the devices a layout search prices; a manual layout has none",
                "set layout='auto' to search the layout on it, or drop cluster",
            )
        return settings, None
    if not engine_class(settings.engine).is_distributed:
        raise config_error(
            f"layout='auto' with engine={settings.engine!r}",
            "a layout spreads the model over a world of processes, one per device, which the "
            "distributed engine runs",
            "add engine='distributed'",
        )
    if cluster is None or not isinstance(cluster, (str, Mapping)):
        raise config_error(
            f"layout='auto' with cluster={cluster!r}",
            "the search needs the devices' figures: a preset's name, 'local' (this machine, "
            "measured), or a mapping of a cluster's fields",
            "add cluster='local' (or 'h100_8', 'h100_8x8', 'a100_8x8', 'h200_1'; docs/LAYOUT.md)",
        )
    given = settings.checkpoint
    if not isinstance(given, str):
        raise config_error(
            f"checkpoint={list(given)} with layout='auto'",
            "the search chooses the stage count, so a mode it keeps is one for every stage",
            "give one mode (checkpoint='always'), or none to let the search choose each stage's",
        )
    placeholder = PipeSettings(**{**named, "layout": "manual", "checkpoint": "never"})
    return placeholder, LayoutSearch(named, cluster)


def _check_unbudgeted(named: Mapping[str, Any]) -> None:
    budget = {k: named[k] for k in _BUDGET if named.get(k) is not None}
    if budget:
        raise config_error(
            f"{', '.join(f'{k}={v!r}' for k, v in budget.items())} with layout='auto'",
            "the search fits every rank of every layout to its device's memory, the cluster's",
            "drop it, or describe the device's memory in cluster (a mapping: device.memory_bytes)",
        )


def searching_launcher(strategy: Any, launcher: Any) -> Any:
    """``launcher``, or, while ``layout="auto"`` has no pick, a launcher that searches first."""
    search: Optional[LayoutSearch] = strategy.layout_search
    if search is None or search.pick is not None:
        return launcher
    return _Searching(strategy, launcher)


class _Searching:
    """The strategy's launcher until the pick: ``launch`` searches (or takes the pick handed on),
    adopts it, and launches with the launcher of the engine that runs it."""

    def __init__(self, strategy: Any, first: Any) -> None:
        self.strategy, self.first = strategy, first

    @property
    def is_interactive_compatible(self) -> bool:
        return bool(self.first.is_interactive_compatible)

    def kill(self, signum: Any) -> None:
        self.first.kill(signum)

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        module, fit = self.strategy.lightning_module, fit_arguments(function, args, kwargs)
        if module is None or fit is None:
            raise config_error(
                f"{GIVEN} before a fit",
                "the layout is searched for the model and its first training batch, at trainer.fit",
                "call trainer.fit(model, ...) first, or give the layout by hand",
            )
        where, name = SEARCH.split(":")
        pick = getattr(importlib.import_module(where), name)(self.strategy, module, *fit)
        adopt(self.strategy, pick)
        log_pick(trainer.loggers if trainer is not None else [], pick)
        return self.strategy.launcher.launch(function, *args, trainer=trainer, **kwargs)


def cut(batch: Any, parts: int) -> Any:
    """``batch`` cut along its samples into ``parts`` equal shares by the distributed engine's own
    rules and code (its micro-batches: every tensor leaf split along dim 0, all of one sample count,
    refused naming the batch otherwise); ``.size`` its samples, ``[i]`` a share, ``.tensors`` its
    tensor leaves. Imported when used: the engine brings torch.distributed."""
    from pipeckpt.engines.distributed.replay import Microbatches

    return Microbatches(batch, parts)


def log_pick(loggers: Sequence[Any], pick: Mapping[str, Any]) -> None:
    """The pick among the run's hyperparameters (a CSV run's ``hparams.yaml``, TensorBoard's
    HPARAMS): the layout with its predictions, and the settings that train it by hand, for whoever
    reads the run later. The loggers write on global rank 0 only."""
    logged = {"layout": pick.get("record"), "layout_settings": pick.get("settings")}
    for logger in loggers:
        logger.log_hyperparams({k: dict(v) for k, v in logged.items() if v is not None})


def adopt(strategy: Any, pick: Dict[str, Any]) -> None:
    """The strategy runs ``pick``: its settings (the script's, the pick's layout), the engine that
    runs them and its launcher."""
    search: LayoutSearch = strategy.layout_search
    settings = PipeSettings(**{**search.named, **pick["settings"], "layout": "manual"})
    engine = engine_class(settings.engine)
    engine.check_settings(settings)
    strategy.settings, strategy.engine = settings, engine(settings)
    search.pick = pick
    relaunch(strategy)


def replica_share(strategy: Any, hook: str, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """``args`` of ``hook`` with the training batch cut to this process's replica's share under
    ``layout="auto"`` (every process reads the whole batch); as given otherwise. Evaluation batches
    are whole on every replica: each replica's figures are the whole batch's."""
    search: Optional[LayoutSearch] = getattr(strategy, "layout_search", None)
    picked = search is not None and search.pick is not None and hook == "training_step"
    replicas = strategy.engine.topology.dp if picked else 1
    if replicas == 1 or not args:
        return args
    shares = cut(args[0], replicas)
    samples = shares.size
    if samples % replicas:
        raise config_error(
            f"a training batch of {samples} samples under {GIVEN}'s {replicas} replicas",
            "each replica trains an equal share of every batch, so the step's gradient is the "
            "whole batch's mean",
            "make every batch's size divisible by the replicas (drop_last=True on the training "
            "DataLoader drops a shorter last batch)",
        )
    return (shares[strategy.engine.topology.replica_of(strategy.global_rank)], *args[1:])
