"""One layout of the app's model fitted on the ranks of :func:`harness.ranks.run_ranks`: its seconds
per step and this rank's peak bytes (:mod:`bench_layout_measured`'s worker).

The model, data and strategy are the app's, built from the same overrides as train.py builds them
and with the pick applied as train.py applies it (:func:`pipeckpt.plan_pick.apply_layout`, given
the search's pick); only the Trainer's extras are off
(:data:`harness.trainers.QUIET_CPU` less its sampler setting: the app's loaders are the strategy's).
"""

import gc
import tempfile
import time
from typing import Any, Dict, List, NamedTuple, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.distributed.tensor import DTensor

from harness.allocated_bytes import AllocatedBytes
from harness.live_bytes import LiveBytes
from harness.trainers import QUIET_CPU

__all__ = ["Fitted", "fit_layout", "ShardBytes"]


def _local(value: Any) -> Any:
    """``value``'s tensors, each DTensor as this rank's local tensor (whose storage the rank holds)."""
    from pipeckpt._compat import tree_flatten

    return [t.to_local() if isinstance(t, DTensor) else t for t in tree_flatten(value)[0]]


class ShardBytes(LiveBytes):
    """:class:`LiveBytes` counting a DTensor by its local shard."""

    def count(self, value: Any, *, op: Optional[str] = None) -> None:
        super().count(_local(value), op=op)


def receive_buffers() -> List[Tensor]:
    """The receive buffers of this process's pipeline stages: torch's ``PipelineStage`` allocates one
    per micro-batch for each activation it takes and each gradient it gets, once, and reuses them
    every step, so they are held through a step that makes none of them (and no op of the step
    returns a gradient's buffer: :class:`LiveBytes` would not see it otherwise)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    stages = [o for o in gc.get_objects() if isinstance(o, _PipelineStageBase)]
    infos = [i for s in stages for d in (s.args_recv_info, s.grad_recv_info) for t in d.values() for i in t]
    return [b for b in (getattr(i, "buffer", None) for i in infos) if isinstance(b, Tensor)]


class Probe(Callback):
    """Times the steps after ``warmup`` (one optimizer step a batch), then counts one more under
    :class:`ShardBytes`, the pipeline stages' receive buffers (:func:`receive_buffers`) with what
    the step begins with. Under ``allocated`` too: a step more, untimed, runs under its profiler
    before the counted one (:class:`AllocatedBytes`: why), whose sentinels it marks around that step."""

    def __init__(self, warmup: int, timed: int, allocated: Optional[AllocatedBytes] = None) -> None:
        self.warmup, self.timed = warmup, timed
        self.starts: List[float] = []
        self.tracker: Optional[ShardBytes] = None
        self.allocated = allocated
        self.peak = 0
        self.base = 0  # what the counted step began with

    @property
    def steps(self) -> int:
        return self.warmup + self.timed + (self.allocated is not None) + 1  # the lead-in, then the counted

    def on_train_batch_start(
        self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        self.starts.append(time.perf_counter())
        if self.allocated is not None and len(self.starts) == self.warmup + self.timed + 1:
            gc.collect()  # an earlier fit's garbage freed while profiling would count as this one's frees
            self.allocated.__enter__()
        if len(self.starts) == self.steps:
            self.tracker = ShardBytes()
            self.tracker.count_step_state(module, trainer.optimizers, batch)
            self.tracker.count(receive_buffers())
            self.base = self.tracker.live
            if self.allocated is not None:
                self.allocated.mark(0)
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            if self.allocated is not None:
                self.allocated.mark(1)
                self.allocated.__exit__(None, None, None)
            self.peak, self.tracker = self.tracker.peak, None

    def seconds_per_step(self) -> float:
        return (self.starts[self.warmup + self.timed] - self.starts[self.warmup]) / self.timed


class Fitted(NamedTuple):
    """One rank's figures of a fitted layout."""

    seconds: float  # per timed step
    peak: int  # bytes, counted by ShardBytes
    pp_rank: int
    allocated: Optional[int]  # bytes as the CPU allocator held them (spec["allocated"]), else None


def fit_layout(spec: Dict[str, Any], row: Dict[str, Any]) -> Fitted:
    """Fits ``row``'s layout (``row["pick"]``, as the search hands it on) for warm-up, timed and one
    counted step; with ``spec["allocated"]``, counted by :class:`AllocatedBytes` too."""
    from bench_layout_measured import _compose
    from hydra.utils import instantiate

    from pipeckpt.plan_pick import apply_layout

    allocated = AllocatedBytes() if spec.get("allocated") else None
    probe = Probe(spec["warmup"], spec["timed"], allocated)
    steps = probe.steps
    with tempfile.TemporaryDirectory() as root:
        cfg = _compose([*spec["overrides"], f"trainer.max_steps={steps}", f"trainer.default_root_dir={root}"])
        cfg = apply_layout(cfg, pick=row["pick"])
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        datamodule = instantiate(cfg.data)
        model = instantiate(cfg.model)
        strategy = instantiate(cfg.strategy, _convert_="all")
        quiet = {k: v for k, v in QUIET_CPU.items() if k != "use_distributed_sampler"}
        trainer = L.Trainer(
            strategy=strategy,
            devices=int(cfg.trainer.devices),
            precision=cfg.trainer.precision,
            max_steps=steps,
            gradient_clip_val=cfg.trainer.gradient_clip_val,
            default_root_dir=root,
            callbacks=[probe],
            **quiet,
        )
        trainer.fit(model, datamodule)
    rank = trainer.global_rank
    pp, tp = row["pp"], int(row["pick"]["settings"]["tensor_parallel"])
    held = None if allocated is None else probe.base + allocated.peak()
    return Fitted(probe.seconds_per_step(), probe.peak, (rank // tp) % pp, held)
