"""``strategy.layout=auto``: the layout search run on the configured model, for the plan command and
for train.py.

Why here, in the CLIs' layer: the search (:mod:`pipeckpt.layout`) takes a model's layers, profiles
and costs as functions; building them from the configs is the plan command's job (the model built as
a fit builds it, on fake tensors when it would not fit this machine: :mod:`pipeckpt.plan_model`), and
train.py applies the pick to the configs before the strategy is built (:mod:`pipeckpt.plan_pick`).
"""

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from pipeckpt._errors import PipeckptConfigError, config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.engines import engine_class
from pipeckpt.engines.distributed.tensor_parallel import check_sequence_parallel
from pipeckpt.layout import cost
from pipeckpt.layout.balance import by_time, with_time_cuts
from pipeckpt.layout.candidates import Candidate, Model, candidates
from pipeckpt.layout.cluster import Cluster, cluster
from pipeckpt.layout.fit import Memory, Shapes
from pipeckpt.layout.floor import step_floor
from pipeckpt.layout.links import Mesh, all_reduce_s
from pipeckpt.layout.pins import Pins
from pipeckpt.layout.rank_work import sharded_collectives_s
from pipeckpt.layout.report import draw, format_search, progress_printer
from pipeckpt.layout.search import Estimate, Searched, search
from pipeckpt.memory.sharding import PRECISIONS
from pipeckpt.plan_fsdp_host import SHARDS
from pipeckpt.plan_fsdp_host import fit as fit_fsdp
from pipeckpt.plan_given import by_hand as script_by_hand
from pipeckpt.plan_model import batch
from pipeckpt.plan_shapes import SearchShapes, heads_of
from pipeckpt.plan_tp_host import fit
from pipeckpt.stages.partition import check_balance

__all__ = [
    "Answer",
    "search_config",
    "check_searchable",
    "configured_cluster",
    "by_hand",
    "sequence_choice",
]


@dataclass(frozen=True)
class Answer:
    """The search on the configured model: its answer, the cluster it ran for, and notes."""

    searched: Searched
    cluster: Cluster
    profiled: Tuple[Tuple[int, int, bool], ...]  # (tp, micro-batch size, sequence split) shapes profiled
    hand: Tuple[str, ...] = ()  # the pick's overrides by hand (:func:`by_hand`), after a search

    def text(self, top: int = 8) -> str:
        d = self.cluster.device
        where = (
            f"on {self.cluster.name} ({self.cluster.world} x {d.name}, {d.memory_bytes / 2**30:.1f} GiB each)"
        )
        shapes = ", ".join(f"tp{tp}{' (sp)' if sp else ''} x {mb}" for tp, mb, sp in self.profiled)
        tail = f"memory profiled on fake tensors: {len(self.profiled)} shapes (tp x micro-batch: {shapes})"
        if _this_machine(self.cluster):
            tail += "; times from one micro-batch timed layer by layer on this machine"
        if self.hand:
            tail += f"\nthe pick by hand, without a search: {' '.join(self.hand)}"
        return f"{format_search(self.searched, top=top, device=where)}\n{tail}"


def _world(cfg: DictConfig) -> Optional[int]:
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes") or 1
    return int(devices) * int(nodes) if isinstance(devices, int) else None


def configured_cluster(cfg: DictConfig) -> Cluster:
    """The run's ``cluster=``, cut to its world (``trainer.devices x trainer.num_nodes``)."""
    spec = cfg.get("cluster")
    if spec is None:
        raise config_error(
            "strategy.layout=auto without cluster",
            "the search needs the devices' figures",
            "add cluster=local",
        )
    given = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else spec
    return cluster(given, devices=_world(cfg))  # type: ignore[arg-type]


def check_searchable(cfg: DictConfig, given: str = "strategy.layout=auto", fix: str = "") -> None:
    """What the search needs of the configs, before any work (``given``: what the user asked that
    needs it): the distributed engine, which runs a layout's world of processes, and a model of
    tokens, whose sequence length prices every layout's work and traffic."""
    engine = cfg.strategy.get("engine")
    if not engine_class(str(engine)).is_distributed:  # the engine's own word, not its name
        raise config_error(
            f"{given} with strategy.engine={engine}",
            "a layout spreads the model over a world of processes, one per device, which the "
            "distributed engine runs",
            "add strategy.engine=distributed" + fix,
        )
    if tokens_per_sample(cfg) is None:
        target = cfg.model.get("_target_") if isinstance(cfg.model, DictConfig) else cfg.model
        raise config_error(
            f"{given} with model._target_={target} (model.seq_len: {OmegaConf.select(cfg, 'model.seq_len')}, "
            f"data.seq_len: {OmegaConf.select(cfg, 'data.seq_len', default=None)})",
            "the search prices a layout by the tokens of a sequence model: an integer model.seq_len "
            "(model=gpt, llama3 or hf), or data.seq_len for a model of your own (model=custom)",
            "train a sequence model, or give the layout by hand (strategy.stages, strategy.dp, "
            "strategy.schedule, strategy.chunks) without it" + fix,
        )


def tokens_per_sample(cfg: DictConfig) -> Optional[int]:
    """The tokens of one sample: the model's ``seq_len``, else the data's (a model of your own,
    ``model=custom``, that takes no such argument); None where neither is an integer."""
    for key in ("model.seq_len", "data.seq_len"):
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _this_machine(where: Cluster) -> bool:
    """``cluster=local``, measured here (a described cluster that happens to be named so is not)."""
    return where.name == "local" and where.source.startswith("measured")


def sequence_choice(cfg: DictConfig, where: Cluster, shapes: SearchShapes, splits: bool) -> bool:
    """Whether the layouts with tp > 1 run sequence parallelism: ``strategy.sequence_parallel`` where
    the user gives it (``true`` refused as the engine would, for a model that cannot); else, on a
    described cluster, wherever the model takes it.

    Why on, and not searched both ways: the cost model prices its all-gather and reduce-scatter as
    the all-reduce they replace, the same bytes (Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models", MLSys 2023, section 4.2.2), and it only takes
    memory away, so a layout without it is never faster nor smaller: searching both would double
    the split layouts to rank the same pick. On ``cluster=local`` a split layer's time is measured
    here, with the plain split (:mod:`pipeckpt.plan_tp_host`), so there it stays the user's."""
    given = cfg.strategy.get("sequence_parallel")
    if given is None and _this_machine(where):
        return False
    whole = shapes.built(1).sequential
    if not (splits or shapes.by_argument):
        return bool(given)  # nothing is split: no layout has tp > 1
    try:
        check_sequence_parallel(whole, dict(shapes.plan_of(whole)))
    except PipeckptConfigError:
        if given:
            raise
        return False
    return given is None or bool(given)


def _local_microbatch(cfg: DictConfig, where: Cluster) -> int:
    """The micro-batch the costs are taken at: the global batch over the world (the costs are per
    token, so any size would do)."""
    return max(1, int(cfg.data.batch_size) // where.world)


class Pricing(NamedTuple):
    """A layout's predicted step, and a step no checkpoint modes can beat (the search's pruning)."""

    estimate: Callable[[Candidate], Estimate]
    floor: Callable[[Candidate], float]
    costs: cost.ModelCosts  # the model as both count it


def _cost(cfg: DictConfig, memory: Memory, where: Cluster, shapes: SearchShapes) -> Pricing:
    """:func:`pipeckpt.layout.cost.estimate` for this model on ``where``, and
    :func:`pipeckpt.layout.floor.step_floor` on the same costs. On ``local`` (this machine)
    the costs are a real step's: one micro-batch timed layer by layer here, its seconds converted at
    the calibrated one-thread rate (a CPU runs a transformer's norms, softmax and small matmuls far
    below its matmul peak, which no FLOP count sees). Elsewhere: from the model's Hugging Face config
    where it has one (the published FLOP count), else from one fake profile of the whole layers (any
    micro-batch: the costs are per token; a fake profile's times are its FLOPs)."""
    seq_len, precision = int(tokens_per_sample(cfg) or 0), str(cfg.trainer.precision)
    global_batch = int(cfg.data.batch_size)
    module = shapes.built(1).module
    config = getattr(module, "hf_config", None)
    microbatch = _local_microbatch(cfg, where)
    heads, _ = heads_of(module)
    name = str(cfg.model._target_).rsplit(".", 1)[-1]
    param_bytes = torch.empty((), dtype=torch.get_default_dtype()).element_size()
    if _this_machine(where):
        from pipeckpt.layout.calibrate import measured

        costs = cost.model_costs_from_profile(
            shapes.timed(microbatch),
            flops_per_s=float(measured()["matmul_flops"]),  # the rate the timing process ran at
            seq_len=seq_len,
            microbatch=microbatch,
            hidden=int(getattr(config, "hidden_size", 0) or 0),
            heads=heads or 0,
            param_bytes=param_bytes,
            name=name,
        )
        if shapes.split_times is not None:  # what a split layer costs here (plan_tp_host)
            times, tp, sizes = shapes.split_times
            bytes_per_token, latency = costs.boundary_bytes_per_token, where.latency_s
            mesh = Mesh(where, pp=1, tp=tp, dp_replicate=where.world // tp, dp_shard=1)
            comm = lambda m: 2 * all_reduce_s(m * seq_len * bytes_per_token, tp, mesh.tp_bytes_per_s, latency)  # noqa: E731
            costs = replace(costs, tensor_parallel=fit(times, tp, sizes, comm))
        costs = replace(costs, split_backward=shapes.split_backward)
        if shapes.fsdp_times is not None:  # what FSDP costs the host here (plan_fsdp_host)
            steps, units = shapes.fsdp_times
            over_ddp = sharded_collectives_s(costs, where, SHARDS, precision)
            costs = replace(costs, fsdp_host=fit_fsdp(steps, units, over_ddp))
    elif config is not None:
        costs = cost.model_costs_from_config(config, seq_len=seq_len, precision=precision)
    else:
        costs = cost.model_costs_from_profile(
            memory.profile(1, microbatch),
            seq_len=seq_len,
            microbatch=microbatch,
            heads=heads or 0,
            param_bytes=param_bytes,
            name=name,
        )
    # how the engine keeps its replicas (layout.replicas)
    costs = replace(costs, module_pipeline=isinstance(shapes.built(1).sequential, ModulePipeline))

    def laid_out(c: Candidate) -> Dict[str, Any]:  # what both read of the run and the layout
        return dict(
            global_batch=global_batch,
            seq_len=seq_len,
            precision=precision,
            reshard_after_forward=c.reshard,
            reduce_every_microbatch=c.reduce_every,
            stage_layers=c.balance or None,  # its own cut (by time), else the engine's default
        )

    def estimate(c: Candidate) -> Estimate:
        return cost.estimate(c, costs, where, **laid_out(c))

    def floor(c: Candidate) -> float:
        return step_floor(c, costs, where, **laid_out(c))

    return Pricing(estimate, floor, costs)


def _check_unbudgeted(cfg: DictConfig) -> None:
    """A budget (``memory.budget``, ``memory.search``) is what ``ckpt=auto`` plans one layout to;
    the search fits every rank of every layout to its device's memory instead, so one named beside
    it would be ignored."""
    named = {k: cfg.strategy.get(f"memory_{k}") for k in ("budget", "search")}
    named = {k: v for k, v in named.items() if v is not None}
    if named:
        values = ", ".join(
            f"memory.{k}={OmegaConf.to_container(v) if not isinstance(v, str) else v}"
            for k, v in named.items()
        )
        raise config_error(
            f"{values} with strategy.layout=auto",
            "the search fits every rank of every layout to its device's memory, the cluster's; a "
            "budget plans one layout's modes",
            "drop it, or describe the device's memory in a cluster of your own "
            "(cluster.device.memory_bytes; docs/LAYOUT.md, 'Describing a cluster')",
        )


@contextlib.contextmanager
def _searching(cfg: DictConfig) -> Iterator[Tuple[Memory, Model, Cluster, SearchShapes]]:
    check_searchable(cfg)
    _check_unbudgeted(cfg)
    where = configured_cluster(cfg)
    precision = str(cfg.trainer.precision)
    drawn = batch(cfg)
    fake = True  # memory is the same on fake tensors, times come from FLOPs: no layout pays a real step
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(PRECISIONS[precision][0] if precision in PRECISIONS else default_dtype)
    try:
        with contextlib.ExitStack() as stack:
            shapes = SearchShapes(cfg, drawn, stack, fake=fake)
            if _this_machine(where):  # this machine's times, before any fake build is open
                shapes.timed(_local_microbatch(cfg, where))
                if where.world > 1:
                    shapes.split_times = shapes.timed_split(_local_microbatch(cfg, where), where.world)
                    shapes.fsdp_times = shapes.timed_fsdp(_local_microbatch(cfg, where))
            whole = shapes.built(1)
            heads, kv = heads_of(whole.module)
            splits = shapes.splits(whole.sequential)
            model = Model(
                layers=len(whole.sequential),
                heads=heads,
                kv_heads=kv,
                tensor_parallel=splits,
                sequence_parallel=sequence_choice(cfg, where, shapes, splits),
            )
            optimizer = cfg.get("memory", {}).get("optimizer") or "adamw"
            memory = Memory(
                Shapes(shapes.layers, shapes.profile),
                device_bytes=where.device.memory_bytes,
                global_batch=int(cfg.data.batch_size),
                precision=precision,
                optimizer=optimizer,
                gloo=_this_machine(where),
            )
            yield memory, model, where, shapes
    finally:
        torch.set_default_dtype(default_dtype)


def search_config(
    cfg: DictConfig,
    *,
    png: Optional[str] = None,
    only: Optional[Sequence[Candidate]] = None,
    top: Optional[int] = None,
    modes: Optional[str] = None,
    pins: Pins = Pins(),
) -> Answer:
    """The layouts of the configured model on the configured cluster, ranked (the plan command's
    ``strategy.layout=auto``); a PNG of the memory-time frontier where ``png`` names one; ``only``:
    these layouts instead of every one (each fitted and predicted as the search does); ``top``: only
    the ``top`` fastest, found without fitting the layouts that cannot be among them
    (:func:`pipeckpt.layout.search.search`'s floor); ``modes``: the one checkpoint mode every stage
    of every layout keeps (:func:`pipeckpt.plan_pick.given_modes`), else each layout's are chosen;
    ``pins``: the settings every layout keeps (:class:`pipeckpt.layout.pins.Pins`), the rest searched."""
    torch.manual_seed(cfg.seed)
    with _searching(cfg) as (memory, model, where, shapes):
        global_batch = int(cfg.data.batch_size)
        found = (
            pins.kept(
                candidates(
                    where.world, model, global_batch=global_batch, devices_per_node=where.devices_per_node
                ),
                model,
                where.world,
                global_batch,
            )
            if only is None
            else only
        )
        for c in found:  # a balance given by hand: its values were the settings', its sum needs the model
            if c.balance:
                check_balance(c.balance, model.layers)
        price = _cost(cfg, memory, where, shapes)
        found = [_named_cut(c, price.costs) for c in found]
        if only is None and not pins.balance:  # each pipelined layout cut by parameters and by time
            found = with_time_cuts(found, price.costs)
        if modes is not None and only is None:
            found = [replace(c, modes=(modes,) * c.stages) for c in found]
        searched = search(
            found,
            device_bytes=where.device.memory_bytes,
            state=memory.state_bytes,
            memory=memory.fit,
            cost=price.estimate,
            progress=progress_printer(),
            top=top,
            floor=price.floor if top else None,
        )
        hand = by_hand(cfg, searched.best.candidate.settings()) if only is None and searched.ranked else []
        answer = Answer(searched, where, tuple(shapes.profiles), tuple(hand))
    if png is not None:
        draw(searched, png, where.device.memory_bytes)
    return answer


def _named_cut(c: Candidate, costs: cost.ModelCosts) -> Candidate:
    """``c``, its balance (given by the user) described as cut by hand where it is not the cut by time."""
    return replace(c, cut_by_hand=True) if c.balance and c.balance != by_time(costs, c.stages) else c


def by_hand(cfg: DictConfig, settings: Dict[str, Any]) -> List[str]:
    """The overrides that train a pick's ``settings`` (:meth:`Candidate.settings`) by hand, in place of
    ``strategy.layout=auto``: the degrees, schedule, chunks, balance, FSDP policies and modes, and the
    batch per replica (under auto, ``data.batch_size`` is the global batch). For a script's
    ``PipelineStrategy(layout="auto")``, the strategy's arguments (:func:`pipeckpt.plan_given.by_hand`)."""
    if cfg.get("given_as"):
        return script_by_hand(settings, int(cfg.data.batch_size))
    out = []
    for key, value in settings.items():
        if key == "checkpoint":
            out.append(f"ckpt.modes=[{','.join(value)}]")
        elif isinstance(value, list):  # the balance: no spaces, one shell word
            out.append(f"strategy.{key}=[{','.join(map(str, value))}]")
        elif value is not None:
            out.append(f"strategy.{key}={str(value).lower() if isinstance(value, bool) else value}")
    if cfg.strategy.get("sequence_parallel") and int(settings.get("tensor_parallel") or 1) == 1:
        out.append("strategy.sequence_parallel=false")  # as apply_layout trains it
    return [*out, f"data.batch_size={int(cfg.data.batch_size) // int(settings['dp'])}"]
