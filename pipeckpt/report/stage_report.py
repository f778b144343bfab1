"""Per-stage time and activation memory, measured during real training steps.

A checkpoint mode trades time for memory, so the report shows, for every stage, its layers,
parameters, peak activation memory, share of the step time and mode. It works under any strategy:
under ``pipe`` the stages are the plan's layer ranges, otherwise the whole ``configure_pipeline()``
Sequential is one stage. Measuring costs time, so only a few steps after a warm-up are measured
(:class:`~pipeckpt.report.probe.StageProbe`): the first with memory, the others for time.
"""

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from pipeckpt.report.probe import StageProbe, pipeline_layers, settled_clock
from pipeckpt.report.render import StageStats, format_table, save_chart

__all__ = ["StageReport"]


class StageReport(L.Callback):
    """Measures steps ``warmup_steps + 1`` to ``warmup_steps + steps`` of a fit
    (counted from the start of that fit, also after a resume), then prints the
    per-stage table (unless ``verbose=False``) and writes ``stage_report.png``
    and ``stage_report.json`` to ``dirpath`` (default: the trainer's
    ``default_root_dir``). The numbers stay in :attr:`stats`.

    Args:
        warmup_steps: the steps left unmeasured first.
        steps: the steps measured.
        dirpath: where the chart and the JSON go; default the trainer's ``default_root_dir``.
        verbose: whether to print the table.
    """

    def __init__(
        self, *, warmup_steps: int = 2, steps: int = 3, dirpath: Optional[str] = None, verbose: bool = True
    ) -> None:
        if warmup_steps < 0 or steps < 1:
            raise ValueError(
                f"StageReport needs warmup_steps >= 0 and steps >= 1 "
                f"(warmup_steps: {warmup_steps}, steps: {steps})"
            )
        self.warmup_steps = warmup_steps
        self.steps = steps
        self.dirpath = dirpath
        self.verbose = verbose
        self.stats: list[StageStats] = []
        self._reset()

    def _reset(self) -> None:
        self._batches = 0
        self._probe: Optional[StageProbe] = None
        self._started = 0.0
        # (step time, forward times, backward times, recomputed micro-batches) per measured step
        self._timed: list[tuple[float, dict[int, float], dict[int, float], dict[int, int]]] = []
        self._fallback: Optional[tuple[float, dict[int, float], dict[int, float], dict[int, int]]] = None
        self._peak: dict[int, int] = {}
        self._boundary: set[int] = set()  # stages whose Stage module the engine calls
        self._ranges: list[tuple[int, int]] = []
        self._modes: list[str] = []
        self._devices: list[torch.device] = []
        self._first, self._last = 0, 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layers = pipeline_layers(pl_module)
        plan = getattr(trainer.strategy, "plan", None)
        if plan is not None:
            self._ranges = list(plan.ranges)
            self._modes = [m.name for m in plan.modes]
            self._devices = list(plan.devices)
        else:
            self._ranges = [(0, len(layers))]
            self._modes = ["none"]
            self._devices = [trainer.strategy.root_device]
        # A short run still gets measured: the warm-up shrinks to leave one step.
        steps_left = trainer.estimated_stepping_batches - trainer.global_step
        budget = (
            int(steps_left) * trainer.accumulate_grad_batches
            if steps_left != float("inf")
            else self.warmup_steps + self.steps
        )
        self._first = max(0, min(self.warmup_steps, budget - 1))
        self._last = self._first + self.steps - 1

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._first <= self._batches <= self._last:
            return
        memory = self._batches == self._first
        stages = list(getattr(trainer.strategy, "stages", None) or ())
        if not memory:
            # The memory step showed which Stage modules the engine calls: those count their own
            # recomputes, and their layers need no hook in the timed steps.
            stages = [stage for stage in stages if stage.index in self._boundary]
        self._probe = StageProbe(
            pipeline_layers(pl_module),
            self._ranges,
            self._devices,
            memory=memory,
            stages=stages,
            count_layers=memory,
        )
        self._started = settled_clock(trainer.strategy.root_device)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        probe, self._probe = self._probe, None
        if probe is None:
            return
        step = settled_clock(trainer.strategy.root_device) - self._started
        probe.remove()
        probe.resolve()
        if probe.memory:
            self._peak = dict(probe.ledger.peak)
            self._boundary = set(probe.covered)
        timing = (step, dict(probe.forward_s), dict(probe.backward_s), dict(probe.recomputed))
        if probe.memory:
            # The memory probe slows its step: its times are used only if no other step is measured.
            self._fallback = timing
        else:
            self._timed.append(timing)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._probe is not None:  # training stopped inside a measured step
            self._probe.remove()
            self._probe = None
        if not self._timed and self._fallback is not None:
            self._timed.append(self._fallback)
        if not self._timed:
            rank_zero_info("StageReport: no training step was measured (the fit ended before it).")
            return
        self.stats = _merged_over_ranks(trainer, self._summarise(pipeline_layers(pl_module)))
        if trainer.is_global_zero:
            out = Path(self.dirpath or trainer.default_root_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "stage_report.json").write_text(json.dumps([asdict(s) for s in self.stats], indent=2))
            save_chart(self.stats, out / "stage_report.png")
            if self.verbose:
                print(format_table(self.stats), flush=True)

    def _summarise(self, layers: nn.Sequential) -> list[StageStats]:
        n = len(self._timed)
        step = sum(t[0] for t in self._timed) / n
        children = list(layers)
        stats = []
        for stage, ((first, stop), mode) in enumerate(zip(self._ranges, self._modes)):
            fwd = sum(t[1].get(stage, 0.0) for t in self._timed) / n
            bwd = sum(t[2].get(stage, 0.0) for t in self._timed) / n
            recomputed = round(sum(t[3].get(stage, 0) for t in self._timed) / n)
            params = sum(p.numel() for layer in children[first:stop] for p in layer.parameters())
            stats.append(
                StageStats(
                    stage=stage,
                    first_layer=first,
                    last_layer=stop - 1,
                    params=params,
                    peak_activation_bytes=self._peak.get(stage, 0),
                    forward_s=fwd,
                    backward_s=bwd,
                    recomputed=recomputed,
                    step_share=(fwd + bwd) / step if step > 0 else 0.0,
                    mode=mode,
                )
            )
        return stats


def _merged_over_ranks(trainer: L.Trainer, stats: list[StageStats]) -> list[StageStats]:
    """Under the distributed engine each process measures only the stages it holds: every
    stage's row comes from a process that holds it (a collective over all ranks)."""
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return stats
    held = [stage.index for stage in getattr(trainer.strategy, "stages", [])]
    pieces: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(pieces, (held, stats))
    merged = list(stats)
    for index in range(len(merged)):
        merged[index] = next((theirs[index] for owned, theirs in pieces if index in owned), merged[index])
    return merged
