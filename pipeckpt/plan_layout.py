"""``strategy.layout=auto``: the layout search run on the configured model, for the plan command and
for train.py.

Why here, in the CLIs' layer: the search (:mod:`pipeckpt.layout`) takes a model's layers, profiles
and costs as functions; building them from the configs is the plan command's job (the model built as
a fit builds it, on fake tensors when it would not fit this machine: :mod:`pipeckpt.plan_model`), and
train.py applies the pick to the configs before the strategy is built. The processes a run starts
(Lightning's launcher runs this script again) do not search again: the launching process hands its
pick to them in the environment (:data:`PICK_VARIABLE`), as their profiles would differ.
"""

import contextlib
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeckpt._errors import PipeckptConfigError, config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.engines import engine_class
from pipeckpt.engines.distributed.model_plan import model_plan
from pipeckpt.engines.distributed.vocab_plan import own_outside_plan
from pipeckpt.layout import cost
from pipeckpt.layout.candidates import Candidate, Model, candidates
from pipeckpt.layout.cluster import Cluster, cluster
from pipeckpt.layout.fit import Memory, Shapes
from pipeckpt.layout.links import Mesh, all_reduce_s
from pipeckpt.layout.report import draw, format_row, format_search
from pipeckpt.layout.search import Estimate, Searched, search
from pipeckpt.layout.split_backward import HALVES, WHOLE
from pipeckpt.memory.profile import ModelProfile
from pipeckpt.memory.repeated import repeat_layer, shortened
from pipeckpt.memory.sharding import PRECISIONS
from pipeckpt.memory.tp_local import one_rank_profile
from pipeckpt.plan_model import Built, batch, built, profiled, split_timed, three_layers
from pipeckpt.plan_ranks import takes_tensor_parallel
from pipeckpt.plan_tp_host import Times, fit, timed_pair

__all__ = ["Answer", "search_config", "apply_layout", "PICK_VARIABLE"]

#: The environment variable the launching process hands its pick to the processes it starts in.
PICK_VARIABLE = "PIPECKPT_LAYOUT_PICK"


@dataclass(frozen=True)
class Answer:
    """The search on the configured model: its answer, the cluster it ran for, and notes."""

    searched: Searched
    cluster: Cluster
    profiled: Tuple[Tuple[int, int], ...]  # (tp, micro-batch size) shapes profiled

    def text(self, top: int = 8) -> str:
        d = self.cluster.device
        where = (
            f"on {self.cluster.name} ({self.cluster.world} x {d.name}, {d.memory_bytes / 2**30:.1f} GiB each)"
        )
        shapes = ", ".join(f"tp{tp} x {mb}" for tp, mb in self.profiled)
        tail = f"memory profiled on fake tensors: {len(self.profiled)} shapes (tp x micro-batch: {shapes})"
        if _this_machine(self.cluster):
            tail += "; times from one micro-batch timed layer by layer on this machine"
        return f"{format_search(self.searched, top=top, device=where)}\n{tail}"


def _world(cfg: DictConfig) -> Optional[int]:
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes") or 1
    return int(devices) * int(nodes) if isinstance(devices, int) else None


def _cluster(cfg: DictConfig) -> Cluster:
    spec = cfg.get("cluster")
    if spec is None:
        raise config_error(
            "strategy.layout=auto without cluster",
            "the search needs the devices' figures",
            "add cluster=local",
        )
    given = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else spec
    return cluster(given, devices=_world(cfg))  # type: ignore[arg-type]


def _check(cfg: DictConfig) -> None:
    engine = cfg.strategy.get("engine")
    if not engine_class(str(engine)).is_distributed:  # the engine's own word, not its name
        raise config_error(
            f"strategy.layout=auto with strategy.engine={engine}",
            "the search lays a model out over a world of processes, which the distributed engine runs",
            "add strategy.engine=distributed",
        )


def _heads(module: Any) -> Tuple[Optional[int], Optional[int]]:
    """The attention heads and KV heads of the model's config (None: it says none)."""
    for m in (module, *getattr(module, "modules", lambda: [])()):
        config = getattr(m, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int):
            kv = getattr(config, "num_key_value_heads", None)
            return heads, kv if isinstance(kv, int) else None
    return None, None


class _Shapes:
    """The configured model's layers and profiles by tensor-parallel degree, each build kept open
    (its fake tensors alive) for the whole search."""

    def __init__(self, cfg: DictConfig, drawn: Any, stack: contextlib.ExitStack, *, fake: bool) -> None:
        self.cfg, self.drawn, self.stack, self.fake = cfg, drawn, stack, fake
        self.by_argument = takes_tensor_parallel(cfg)
        self._built: Dict[int, Built] = {}
        self.profiles: Dict[Tuple[int, int], ModelProfile] = {}
        self._timed: Dict[int, ModelProfile] = {}
        self.split_times: Optional[Tuple[Times, int, Tuple[int, int]]] = None  # timed_split's, where taken
        self._rooted = False  # the timed build is a model its own plan splits (:meth:`splits`)
        self.split_backward = HALVES  # a split backward's passes, as timed (:meth:`timed`)

    def built(self, tp: int) -> Built:
        key = tp if self.by_argument else 1
        if key not in self._built:
            extra = {"tensor_parallel": tp} if self.by_argument and tp > 1 else {}
            self._built[key] = self.stack.enter_context(
                built(self.cfg, self.drawn, fake=self.fake, extra=extra)
            )
        return self._built[key]

    def layers(self, tp: int) -> Tuple[torch.nn.Sequential, Tuple[Tuple[str, str], ...]]:
        sequential = self.built(tp).sequential
        if tp == 1 or self.by_argument:
            return sequential, ()
        return sequential, self._plan(sequential, tp)

    def splits(self, sequential: torch.nn.Sequential) -> bool:
        """Whether a plan splits ``sequential``'s layers: ``tensor_parallel_plan`` given, or a
        ``pipeline_of`` model whose own plan names submodules inside them (:func:`model_plan`). An
        HF GPT-2 has none (its Conv1D layers): offered tp 2, the search ended on the plan's refusal."""
        if self.cfg.strategy.get("tensor_parallel_plan"):
            return True
        if not isinstance(sequential, ModulePipeline):
            return False
        try:
            model_plan(sequential, 1)
        except PipeckptConfigError:
            return False
        return True

    def _plan(self, sequential: torch.nn.Sequential, tp: int) -> Tuple[Tuple[str, str], ...]:
        """The engine's plan (tensor_parallel.layer_plan): ``tensor_parallel_plan`` where given, else
        a ``pipeline_of`` model's own: its layers', and the embedding and head split over the
        vocabulary where the model's plan says so."""
        given = self.cfg.strategy.get("tensor_parallel_plan")
        if given:
            return tuple((str(k), str(v)) for k, v in given.items())
        assert isinstance(sequential, ModulePipeline)  # Model.tensor_parallel says so
        return tuple({**model_plan(sequential, tp), **own_outside_plan(sequential)}.items())

    def profile(self, tp: int, microbatch: int) -> ModelProfile:
        """One micro-batch's profile, once per distinct shape: one tensor-parallel rank's layers, as
        the model builds them or as a plan cuts them (:func:`one_rank_profile`)."""
        key = (tp if self.by_argument or self._cut(tp) else 1, microbatch)
        if key not in self.profiles:
            self.profiles[key] = self._profile(tp, microbatch)
        return self.profiles[key]

    def _cut(self, tp: int) -> Dict[str, str]:
        """The plan a layer is cut by for one rank's profile (empty: profiled as built)."""
        return {} if self.by_argument or tp == 1 else dict(self.layers(tp)[1])

    def _profile(self, tp: int, microbatch: int) -> ModelProfile:
        full, plan = self.built(tp).sequential, self._cut(tp)
        short_cfg = three_layers(self.cfg, full)
        if short_cfg is None and not plan:
            return self._profiled(self.built(tp), microbatch)
        extra = {"tensor_parallel": tp} if self.by_argument and tp > 1 else {}
        with built(short_cfg or self.cfg, self.drawn, fake=True, extra=extra) as b:  # a build to cut
            fitted = one_rank_profile(b.sequential, plan, tp, lambda: self._profiled(b, microbatch))
            return fitted if short_cfg is None else repeat_layer(fitted, 1, len(full) - 2)

    def timed(self, microbatch: int) -> ModelProfile:
        """One micro-batch through the whole model built on real tensors, timed on this machine (the
        ``local`` cluster's compute): every layer run, none repeated, so each is its own time; on
        the torch threads each training process takes (``threads``), as the rate it converts at is
        one thread's. Taken before any fake build is open (a fake build swaps fake tensors in for
        as long as it is open, and a real step run then would time fake kernels), then kept."""
        if microbatch in self._timed:
            return self._timed[microbatch]
        assert not self._built, "timed before the fake builds: they swap in fake tensors while open"
        threads, wanted = torch.get_num_threads(), self.cfg.get("threads")
        torch.set_num_threads(int(wanted) if wanted else threads)
        try:
            with built(self.cfg, self.drawn, fake=False) as b:
                self._timed[microbatch] = self._profiled(b, microbatch, fake=False, shorten=False)
                self._rooted = self.splits(b.sequential)
                self.split_backward = split_timed(self.cfg, b, microbatch)
        finally:
            torch.set_num_threads(threads)
        return self._timed[microbatch]

    def timed_split(self, microbatch: int, world: int) -> Optional[Tuple[Times, int, Tuple[int, int]]]:
        """:mod:`pipeckpt.plan_tp_host`'s times of the model unsplit and split by its plan
        (:meth:`_plan`) over real processes, at the least degree a layout of ``world`` processes
        may take and at ``microbatch`` and twice that, with the degree and the sizes; None where the
        model splits itself (``tensor_parallel`` is its own argument), has no plan, no degree the
        world and its heads allow, or this process is in a process group already (a run under
        torchrun or SLURM, whose processes each search alone). Taken after :meth:`timed` and before
        any fake build is open."""
        assert not self._built, "timed before the fake builds: they swap in fake tensors while open"
        if self.by_argument or not (self.cfg.strategy.get("tensor_parallel_plan") or self._rooted):
            return None  # no plan: nothing to split
        if dist.is_available() and dist.is_initialized():
            return None
        with built(self.cfg, self.drawn, fake=False) as b:
            heads = [h for h in _heads(b.module) if h]
            tp = next((t for t in range(2, world + 1) if not world % t and not any(h % t for h in heads)), 0)
            plan = self._plan(b.sequential, tp) if tp else ()
        if not tp:
            return None
        sizes = (microbatch, 2 * microbatch)
        return timed_pair(self.cfg, plan, tp, sizes), tp, sizes

    def _profiled(
        self, b: Built, microbatch: int, *, fake: Optional[bool] = None, shorten: bool = True
    ) -> ModelProfile:
        sequential = b.sequential
        rooted = isinstance(sequential, ModulePipeline)
        short, index, count = shortened(sequential) if shorten and not rooted else (sequential, 0, 1)
        fitted = profiled(self.cfg, b, microbatch, fake=self.fake if fake is None else fake, sequential=short)
        return repeat_layer(fitted, index, count) if count > 1 else fitted


def _this_machine(where: Cluster) -> bool:
    """``cluster=local``, measured here (a described cluster that happens to be named so is not)."""
    return where.name == "local" and where.source.startswith("measured")


def _local_microbatch(cfg: DictConfig, where: Cluster) -> int:
    """The micro-batch the costs are taken at: the global batch over the world (the costs are per
    token, so any size would do)."""
    return max(1, int(cfg.data.batch_size) // where.world)


def _cost(
    cfg: DictConfig, memory: Memory, where: Cluster, shapes: "_Shapes"
) -> Callable[[Candidate], Estimate]:
    """:func:`pipeckpt.layout.cost.estimate` for this model on ``where``. On ``local`` (this machine)
    the costs are a real step's: one micro-batch timed layer by layer here, its seconds converted at
    the calibrated one-thread rate (a CPU runs a transformer's norms, softmax and small matmuls far
    below its matmul peak, which no FLOP count sees). Elsewhere: from the model's Hugging Face config
    where it has one (the published FLOP count), else from one fake profile of the whole layers (any
    micro-batch: the costs are per token; a fake profile's times are its FLOPs)."""
    seq_len, precision = int(cfg.model.seq_len), str(cfg.trainer.precision)
    global_batch = int(cfg.data.batch_size)
    module = shapes.built(1).module
    config = getattr(module, "hf_config", None)
    microbatch = _local_microbatch(cfg, where)
    heads, _ = _heads(module)
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
    if isinstance(shapes.built(1).sequential, ModulePipeline):  # its stages do not split
        costs = replace(costs, split_backward=WHOLE)

    def estimate(c: Candidate) -> Estimate:
        return cost.estimate(
            c,
            costs,
            where,
            global_batch=global_batch,
            seq_len=seq_len,
            precision=precision,
            reshard_after_forward=c.reshard,
        )

    return estimate


@contextlib.contextmanager
def _searching(cfg: DictConfig) -> Iterator[Tuple[Memory, Model, Cluster, "_Shapes"]]:
    _check(cfg)
    where = _cluster(cfg)
    precision = str(cfg.trainer.precision)
    drawn = batch(cfg)
    fake = True  # memory is the same on fake tensors, times come from FLOPs: no layout pays a real step
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(PRECISIONS[precision][0] if precision in PRECISIONS else default_dtype)
    try:
        with contextlib.ExitStack() as stack:
            shapes = _Shapes(cfg, drawn, stack, fake=fake)
            if _this_machine(where):  # this machine's times, before any fake build is open
                shapes.timed(_local_microbatch(cfg, where))
                if where.world > 1:
                    shapes.split_times = shapes.timed_split(_local_microbatch(cfg, where), where.world)
            whole = shapes.built(1)
            heads, kv = _heads(whole.module)
            splits = shapes.splits(whole.sequential)
            model = Model(layers=len(whole.sequential), heads=heads, kv_heads=kv, tensor_parallel=splits)
            optimizer = cfg.get("memory", {}).get("optimizer") or "adamw"
            memory = Memory(
                Shapes(shapes.layers, shapes.profile),
                device_bytes=where.device.memory_bytes,
                global_batch=int(cfg.data.batch_size),
                precision=precision,
                optimizer=optimizer,
            )
            yield memory, model, where, shapes
    finally:
        torch.set_default_dtype(default_dtype)


def search_config(cfg: DictConfig, *, png: Optional[str] = None) -> Answer:
    """The layouts of the configured model on the configured cluster, ranked (the plan command's
    ``strategy.layout=auto``); a PNG of the memory-time frontier where ``png`` names one."""
    torch.manual_seed(cfg.seed)
    with _searching(cfg) as (memory, model, where, shapes):
        found = candidates(where.world, model, global_batch=int(cfg.data.batch_size))
        searched = search(
            found,
            device_bytes=where.device.memory_bytes,
            state=memory.state_bytes,
            memory=memory.fit,
            cost=_cost(cfg, memory, where, shapes),
        )
        answer = Answer(searched, where, tuple(shapes.profiles))
    if png is not None:
        draw(searched, png, where.device.memory_bytes)
    return answer


def apply_layout(cfg: DictConfig, say: Any = print) -> DictConfig:
    """``cfg`` with ``strategy.layout=auto`` replaced by the layout the search picks (``cfg`` itself
    when the layout is manual): the strategy's degrees, schedule, chunks and modes, and the data's
    batch per replica (``data.batch_size`` is the global batch under auto). The launching process
    searches and hands its pick on (:data:`PICK_VARIABLE`); the processes it starts take it."""
    if not isinstance(cfg.strategy, DictConfig) or cfg.strategy.get("layout") != "auto":
        return cfg
    handed = os.environ.get(PICK_VARIABLE)
    if handed is None:
        answer = search_config(cfg)
        best = answer.searched.best
        say(answer.text(top=5), flush=True)
        pick: Dict[str, Any] = {
            "settings": best.candidate.settings(),
            "dp": best.candidate.dp,
            "row": format_row(1, best),
        }
        os.environ[PICK_VARIABLE] = json.dumps(pick)
        say(f"strategy.layout=auto: training with {pick['row'].strip()}", flush=True)
    else:
        pick = json.loads(handed)
    picked = cfg.copy()
    with open_dict(picked):
        for key, value in pick["settings"].items():
            picked.strategy[key] = value
        picked.strategy.layout = "manual"
        picked.strategy.memory_budget = None
        picked.strategy.memory_search = None
        picked.data.batch_size = int(cfg.data.batch_size) // int(pick["dp"])
    return picked
