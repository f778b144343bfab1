"""``strategy.layout=auto`` applied to train.py's configs: the search's pick written into the
strategy and data settings, and agreed by every process of the run.

Why a module of its own: the search (:mod:`pipeckpt.plan_layout`) answers for one process; a run has
many. The processes Lightning's launcher starts (it runs train.py again) do not search again: the
launching process hands its pick to them in the environment (:data:`PICK_VARIABLE`), as their
profiles would differ. Under a launcher outside Lightning (torchrun, srun), where every process runs
the script itself, global rank 0 searches and hands its pick to the others through the run's store
(:func:`pipeckpt.engines.distributed.startup.from_rank_zero`).
"""

import json
import os
from typing import Any, Dict, Optional, Sequence

from lightning.fabric.plugins.environments import ClusterEnvironment
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.processes import SETTINGS, check_time_limit
from pipeckpt.engines.distributed.startup import from_rank_zero, outside_launcher
from pipeckpt.layout.pins import PINNABLE, Pins
from pipeckpt.layout.report import format_row, pick_record
from pipeckpt.plan_layout import check_searchable, search_config
from pipeckpt.settings import PipeSettings

__all__ = ["apply_layout", "agreed_pick", "given_layout", "given_modes", "handed_on", "PICK_VARIABLE"]

#: The environment variable the launching process hands its pick to the processes it starts in.
PICK_VARIABLE = "PIPECKPT_LAYOUT_PICK"

#: The layouts train.py prints before training with the first: the search ranks these only.
SHOWN = 5

#: The command line's keys that name the checkpoint modes (``ckpt=always``): under
#: ``strategy.layout=auto`` the mode named is kept on every stage of every layout.
MODE_KEYS = ("ckpt", "ckpt.modes", "strategy.checkpoint")


def _devices(cfg: DictConfig) -> int:
    """Processes per node: ``trainer.devices`` (1 where it is not a count)."""
    devices = cfg.trainer.get("devices")
    return int(devices) if isinstance(devices, int) else 1


def given_layout(cfg: DictConfig, overrides: Sequence[str]) -> Pins:
    """The layout settings the command line names (``strategy.tensor_parallel=2``, among
    ``overrides``), which a search keeps while it searches the rest. A value in a config file is a
    default, not the user's choice. The settings' own checks (counts, a balance's values, the
    schedule's name) run here, before any work; how the pins combine, the search answers (the
    engine's rules between settings, such as DDP refusing tensor parallelism, are for the layouts
    it picks, not for the pins alone)."""
    named = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    values = {k: cfg.strategy.get(k) for k in PINNABLE if f"strategy.{k}" in named}
    values = {k: OmegaConf.to_container(v) if isinstance(v, ListConfig) else v for k, v in values.items()}
    values = {k: v for k, v in values.items() if v is not None}
    PipeSettings(**{"engine": "distributed", **values})
    return Pins(values)


def given_modes(cfg: DictConfig, overrides: Sequence[str]) -> Optional[str]:
    """The checkpoint mode the command line names (``ckpt=always``, among ``overrides``), which a
    search keeps on every stage of every layout; None where the modes are the search's to choose:
    none named (``conf/train.yaml``'s default is not the user's choice), or ``ckpt=auto``."""
    if not any(o.lstrip("+~").split("=", 1)[0] in MODE_KEYS for o in overrides):
        return None
    given = cfg.strategy.get("checkpoint")
    names = [given] if isinstance(given, str) else list(given or [])
    if names == ["auto"]:
        return None
    if len(names) != 1:
        raise config_error(
            f"checkpoint modes {names} ({len(names)} modes) with strategy.layout=auto",
            "the search chooses the stage count, so a mode it keeps is one for every stage",
            "give one mode (ckpt=always), or name none to let the search choose each stage's",
        )
    return str(names[0])


def apply_layout(
    cfg: DictConfig, say: Any = print, overrides: Sequence[str] = (), pick: Optional[Dict[str, Any]] = None
) -> DictConfig:
    """``cfg`` with ``strategy.layout=auto`` replaced by the layout the search picks (``cfg`` itself
    when the layout is manual): the strategy's degrees, schedule, chunks and modes, and the data's
    batch per replica (``data.batch_size`` is the global batch under auto). The launching process
    searches and hands its pick on (:data:`PICK_VARIABLE`); the processes it starts take it. Under
    torchrun or srun, global rank 0 searches and the others wait for its pick (up to the strategy's
    ``start_timeout``), so every rank trains the same layout. A mode named in ``overrides``
    (the command line's) is kept on every stage (:func:`given_modes`). ``pick``: a pick made earlier
    (as a search hands it on), applied without a search."""
    if not isinstance(cfg.strategy, DictConfig) or cfg.strategy.get("layout") != "auto":
        return cfg
    modes, pins = given_modes(cfg, overrides), given_layout(cfg, overrides)
    pick = agreed_pick(cfg, say, modes, pins) if pick is None else handed_on(pick)
    picked = cfg.copy()
    with open_dict(picked):
        for key, value in pick["settings"].items():
            picked.strategy[key] = value
        picked.strategy.layout = "manual"
        picked.strategy.memory_budget = None
        picked.strategy.memory_search = None
        picked.data.batch_size = int(cfg.data.batch_size) // int(pick["dp"])
        picked.layout_pick = {k: pick[k] for k in ("record", "settings") if k in pick}  # train.py logs it
    return picked


def agreed_pick(cfg: DictConfig, say: Any, modes: Optional[str], pins: Pins) -> Dict[str, Any]:
    """The run's pick, the same on every process: the one this process's parent handed on, else
    global rank 0's search under a launcher outside Lightning, else this process's own search;
    handed on to the processes this one starts. Shared by :func:`apply_layout` and
    ``PipelineStrategy(layout="auto")`` (:mod:`pipeckpt.strategy_layout`)."""
    pick = _from_parent()
    if pick is None:
        nodes = int(cfg.trainer.get("num_nodes") or 1)
        outside = outside_launcher(devices=_devices(cfg), num_nodes=nodes)
        pick = (
            _searched_pick(cfg, say, modes, pins)
            if outside is None
            else _rank_zeros(cfg, say, modes, pins, outside)
        )
    return handed_on(pick)


def handed_on(pick: Dict[str, Any]) -> Dict[str, Any]:
    """``pick``, written where the processes this one starts find it (:data:`PICK_VARIABLE`)."""
    os.environ[PICK_VARIABLE] = json.dumps(dict(pick, by=os.getpid()))
    return pick


def _from_parent() -> Optional[Dict[str, Any]]:
    """The pick this process's parent handed on (:data:`PICK_VARIABLE`): Lightning's launcher is the
    parent of the processes it starts. A pick by any other process is not this run's: an earlier run
    of a Hydra sweep in this same process, or a variable the shell or a job's environment carried."""
    raw = os.environ.get(PICK_VARIABLE)
    try:
        handed = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return None
    return handed if isinstance(handed, dict) and handed.get("by") == os.getppid() else None


def _rank_zeros(
    cfg: DictConfig, say: Any, modes: Optional[str], pins: Pins, outside: ClusterEnvironment
) -> Dict[str, Any]:
    """Global rank 0's pick, on every process an outside launcher started: rank 0 searches, the
    others wait for its pick within the strategy's ``start_timeout``."""
    check_searchable(cfg)  # on every rank, before any waits
    given = cfg.strategy.get("start_timeout")
    window = check_time_limit(
        "start_timeout", SETTINGS["start_timeout"] if given is None else given, "the start-up", 600
    )
    text = from_rank_zero(
        outside,
        "layout",
        lambda: json.dumps(_searched_pick(cfg, say, modes, pins)),
        window_s=window,
        what="the layout search (strategy.layout=auto)",
    )
    pick: Dict[str, Any] = json.loads(text)
    if outside.global_rank() != 0:
        given = cfg.get("given_as") or "strategy.layout=auto"
        say(f"{given}: training with {pick['row'].strip()} (rank 0's search)", flush=True)
    return pick


def _searched_pick(cfg: DictConfig, say: Any, modes: Optional[str], pins: Pins) -> Dict[str, Any]:
    """The search's pick, printed with its runners-up: the settings, replicas and table row."""
    answer = search_config(
        cfg, top=SHOWN, modes=modes, pins=pins
    )  # the pick and its runners-up: nothing else fitted
    best = answer.searched.best
    say(answer.text(top=SHOWN), flush=True)
    row = format_row(1, best)
    say(f"{cfg.get('given_as') or 'strategy.layout=auto'}: training with {row.strip()}", flush=True)
    return {
        "settings": best.candidate.settings(),
        "dp": best.candidate.dp,
        "row": row,
        "record": pick_record(best),
    }
