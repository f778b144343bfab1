"""The configured model as the layout search sees it: its layers and profiles by tensor-parallel
degree, and on ``cluster=local`` its times on this machine.

Why apart from :mod:`pipeckpt.plan_layout`: the search's builds are kept open for its whole length
(a fake build's tensors live as long as it is open), and the measurements taken on this machine
(a real step, a tensor-parallel split, FSDP's host work) must all run before the first fake build
opens. This class owns that order; plan_layout turns what it holds into costs.
"""

import contextlib
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.engines.distributed.model_plan import model_plan
from pipeckpt.engines.distributed.vocab_plan import own_outside_plan
from pipeckpt.layout.split_backward import HALVES
from pipeckpt.memory.profile import ModelProfile
from pipeckpt.memory.repeated import repeat_layer, shortened
from pipeckpt.memory.tp_local import one_rank_profile
from pipeckpt.plan_fsdp_host import Times as FsdpTimes
from pipeckpt.plan_fsdp_host import timed, units
from pipeckpt.plan_model import Built, built, profiled, split_timed, three_layers
from pipeckpt.plan_ranks import takes_tensor_parallel
from pipeckpt.plan_tp_host import Times, timed_pair

__all__ = ["SearchShapes", "heads_of"]


def heads_of(module: Any) -> Tuple[Optional[int], Optional[int]]:
    """The attention heads and KV heads of the model's config (None: it says none)."""
    for m in (module, *getattr(module, "modules", lambda: [])()):
        config = getattr(m, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int):
            kv = getattr(config, "num_key_value_heads", None)
            return heads, kv if isinstance(kv, int) else None
    return None, None


class SearchShapes:
    """The configured model's layers and profiles by tensor-parallel degree, each build kept open
    (its fake tensors alive) for the whole search."""

    def __init__(self, cfg: DictConfig, drawn: Any, stack: contextlib.ExitStack, *, fake: bool) -> None:
        self.cfg, self.drawn, self.stack, self.fake = cfg, drawn, stack, fake
        self.by_argument = takes_tensor_parallel(cfg)
        self._built: Dict[int, Built] = {}
        self.profiles: Dict[Tuple[int, int, bool], ModelProfile] = {}
        self._timed: Dict[int, ModelProfile] = {}
        self.split_times: Optional[Tuple[Times, int, Tuple[int, int]]] = None  # timed_split's, where taken
        self._rooted = False  # the timed build is a model its own plan splits (:meth:`splits`)
        self.split_backward = HALVES  # a split backward's passes, as timed (:meth:`timed`)
        self.fsdp_times: Optional[Tuple[FsdpTimes, int]] = None  # timed_fsdp's, where taken
        self._units = 0  # the timed build's layers that FSDP shards (plan_fsdp_host.units)

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

    def plan_of(self, sequential: torch.nn.Sequential) -> Tuple[Tuple[str, str], ...]:
        """The plan that splits ``sequential``'s layers (:meth:`_plan`) as named at any degree;
        empty for a model built as one rank's share by its own argument."""
        return () if self.by_argument else self._plan(sequential, 1)

    def _plan(self, sequential: torch.nn.Sequential, tp: int) -> Tuple[Tuple[str, str], ...]:
        """The engine's plan (tensor_parallel.layer_plan): ``tensor_parallel_plan`` where given, else
        a ``pipeline_of`` model's own: its layers', and the embedding and head split over the
        vocabulary where the model's plan says so."""
        given = self.cfg.strategy.get("tensor_parallel_plan")
        if given:
            return tuple((str(k), str(v)) for k, v in given.items())
        assert isinstance(sequential, ModulePipeline)  # Model.tensor_parallel says so
        return tuple({**model_plan(sequential, tp), **own_outside_plan(sequential)}.items())

    def profile(self, tp: int, microbatch: int, sequence: bool = False) -> ModelProfile:
        """One micro-batch's profile, once per distinct shape: one tensor-parallel rank's layers, as
        the model builds them or as a plan cuts them (:func:`one_rank_profile`); ``sequence``: the
        rank's part of the sequence too, where a plan cuts the layers (sequence parallelism)."""
        cut = bool(self._cut(tp))
        key = (tp if self.by_argument or cut else 1, microbatch, sequence and cut)
        if key not in self.profiles:
            self.profiles[key] = self._profile(tp, microbatch, key[2])
        return self.profiles[key]

    def _cut(self, tp: int) -> Dict[str, str]:
        """The plan a layer is cut by for one rank's profile (empty: profiled as built)."""
        return {} if self.by_argument or tp == 1 else dict(self.layers(tp)[1])

    def _profile(self, tp: int, microbatch: int, sequence: bool) -> ModelProfile:
        full, plan = self.built(tp).sequential, self._cut(tp)
        short_cfg = three_layers(self.cfg, full)
        if short_cfg is None and not plan:
            return self._profiled(self.built(tp), microbatch)
        extra = {"tensor_parallel": tp} if self.by_argument and tp > 1 else {}
        with built(short_cfg or self.cfg, self.drawn, fake=True, extra=extra) as b:  # a build to cut
            fitted = one_rank_profile(
                b.sequential, plan, tp, lambda: self._profiled(b, microbatch), sequence=sequence
            )
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
                self._units = units(b.sequential)
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
            heads = [h for h in heads_of(b.module) if h]
            tp = next((t for t in range(2, world + 1) if not world % t and not any(h % t for h in heads)), 0)
            plan = self._plan(b.sequential, tp) if tp else ()
        if not tp:
            return None
        sizes = (microbatch, 2 * microbatch)
        return timed_pair(self.cfg, plan, tp, sizes), tp, sizes

    def timed_fsdp(self, microbatch: int) -> Optional[Tuple[FsdpTimes, int]]:
        """:mod:`pipeckpt.plan_fsdp_host`'s times of the model's training step sharded and under DDP
        on its own processes, with the layers it shards; None where none trains or this process is
        in a process group already (as :meth:`timed_split`). Taken after :meth:`timed`, before any
        fake build is open."""
        assert not self._built, "timed before the fake builds: they swap in fake tensors while open"
        if not self._units or (dist.is_available() and dist.is_initialized()):
            return None
        return timed(self.cfg, microbatch), self._units

    def _profiled(
        self, b: Built, microbatch: int, *, fake: Optional[bool] = None, shorten: bool = True
    ) -> ModelProfile:
        sequential = b.sequential
        rooted = isinstance(sequential, ModulePipeline)
        short, index, count = shortened(sequential) if shorten and not rooted else (sequential, 0, 1)
        fitted = profiled(self.cfg, b, microbatch, fake=self.fake if fake is None else fake, sequential=short)
        return repeat_layer(fitted, index, count) if count > 1 else fitted
