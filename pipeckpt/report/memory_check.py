"""Measured against predicted per-stage peak memory, during training (the ``MemoryCheck`` callback).

Why: a memory model that drifts from what the run holds would let a plan that "fits" run out of
memory. This measures one training step per stage, logs both figures, and warns when a stage holds
more than predicted by more than ``tolerance``. What is measured on CUDA and elsewhere (a lower
bound that cannot raise a false alarm): docs/DESIGN.md, report/memory_check.
"""

import warnings
from typing import Any, List, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from pipeckpt._errors import PipeckptWarning
from pipeckpt.memory.budget import first_microbatch
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import profile
from pipeckpt.report.probe import StageProbe, pipeline_layers
from pipeckpt.sizes import MiB

__all__ = ["MemoryCheck"]


def _first(optimizers: Sequence[Any]) -> Any:
    return optimizers[0] if optimizers else "adam"


class MemoryCheck(L.Callback):
    """Measures training step ``step`` (0-based, counted in this fit) per stage, logs
    ``memory/stage{i}_measured_MiB`` and ``..._predicted_MiB``, and warns when a stage's measured
    peak exceeds its predicted one by more than ``tolerance`` (a fraction). ``predicted``: the
    figures (bytes per stage) to check against instead of the memory model's. ``optimizer``: the
    optimizer the model counts (default: the strategy's ``memory_optimizer``, else the trainer's)."""

    def __init__(
        self,
        *,
        step: int = 1,
        tolerance: float = 0.10,
        predicted: Optional[Sequence[int]] = None,
        optimizer: Optional[str] = None,
    ) -> None:
        if step < 0 or tolerance < 0:
            raise ValueError(
                f"MemoryCheck needs step >= 0 and tolerance >= 0 (step {step}, tolerance {tolerance})"
            )
        self.step = step
        self.tolerance = tolerance
        self.predicted: Optional[List[int]] = list(predicted) if predicted is not None else None
        self.optimizer = optimizer
        self.measured: List[int] = []
        self.source = ""
        self._batches = 0
        self._probe: Optional[StageProbe] = None

    # -- the prediction ------------------------------------------------------------------

    def _predict(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any) -> Optional[List[int]]:
        strategy = trainer.strategy
        auto = getattr(strategy, "auto_plan", None)
        if auto is not None:
            return [s.peak for s in auto.choice.prediction.stages]
        plan, engine = getattr(strategy, "plan", None), getattr(strategy, "engine", None)
        if plan is None or engine is None or not isinstance(batch, (tuple, list)):
            return None
        settings = engine.settings
        if not engine.holds_every_layer:
            # Profiling runs every layer of the model, and this process holds only its own
            # stages' (the others are on the meta device): predict with python -m pipeckpt.plan.
            rank_zero_info(
                f"MemoryCheck: no prediction under engine={settings.engine!r} (use python -m pipeckpt.plan)"
            )
            return None
        schedule = engine.memory_schedule(settings)
        loss_fn = getattr(pl_module, "pipeline_loss", None)
        inputs, target = batch[0], batch[1] if len(batch) > 1 and callable(loss_fn) else None
        chunks = settings.chunks
        layers = pipeline_layers(pl_module)
        with trainer.precision_plugin.forward_context():  # profiled as the step runs
            fitted = profile(
                layers,
                first_microbatch(inputs, chunks),
                loss_fn=loss_fn if target is not None else None,
                target=first_microbatch(target, chunks) if target is not None else None,
                rounds=1,
                split_backward=False,  # predict's schedules never split a backward
            )
        prediction = predict(
            fitted,
            plan,
            chunks=chunks,
            optimizer=self.optimizer or settings.memory_optimizer or _first(trainer.optimizers),
            schedule=schedule,
            accumulating=trainer.accumulate_grad_batches > 1,
        )
        return [s.peak for s in prediction.stages]

    # -- the measurement -----------------------------------------------------------------

    def _cuda_devices(self, trainer: L.Trainer) -> Optional[List[torch.device]]:
        plan = getattr(trainer.strategy, "plan", None)
        if plan is None:
            return None
        devices = list(plan.devices)
        if all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices):
            return devices
        return None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._batches != self.step or getattr(trainer.strategy, "plan", None) is None:
            return
        if self.predicted is None:
            self.predicted = self._predict(trainer, pl_module, batch)
        if self.predicted is None:
            return
        devices = self._cuda_devices(trainer)
        if devices is not None:
            for d in devices:
                torch.cuda.reset_peak_memory_stats(d)
            self.source = "cuda max_memory_allocated"
        else:
            plan = trainer.strategy.plan  # type: ignore[attr-defined]
            self._probe = StageProbe(
                pipeline_layers(pl_module), list(plan.ranges), list(plan.devices), memory=True
            )
            self.source = "lower bound: params, grads, optimizer state, forward and recompute allocations"

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if self._batches - 1 != self.step or self.predicted is None or not self.source:
            return
        plan = trainer.strategy.plan  # type: ignore[attr-defined]
        devices = self._cuda_devices(trainer)
        if devices is not None:
            self.measured = [int(torch.cuda.max_memory_allocated(d)) for d in devices]
        else:
            probe, self._probe = self._probe, None
            assert probe is not None
            probe.remove()
            layers = list(pipeline_layers(pl_module))
            state = _optimizer_state_bytes(trainer)
            self.measured = []
            for j, (a, b) in enumerate(plan.ranges):
                params = [p for layer in layers[a:b] for p in layer.parameters()]
                held = sum(_nbytes(p) + (_nbytes(p.grad) if p.grad is not None else 0) for p in params)
                held += sum(state.get(id(p), 0) for p in params)
                self.measured.append(held + probe.ledger.peak.get(j, 0))
        self._report(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None

    def _report(self, trainer: L.Trainer) -> None:
        assert self.predicted is not None
        metrics = {}
        over = []
        for j, (m, p) in enumerate(zip(self.measured, self.predicted)):
            metrics[f"memory/stage{j}_measured_MiB"] = m / MiB
            metrics[f"memory/stage{j}_predicted_MiB"] = p / MiB
            if m > (1 + self.tolerance) * p:
                over.append(
                    f"stage {j}: measured {m / MiB:.2f} MiB, predicted {p / MiB:.2f} MiB ({m / p - 1:+.0%})"
                )
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(
            "MemoryCheck ("
            + self.source
            + "): "
            + ", ".join(
                f"stage {j} {m / MiB:.2f} / {p / MiB:.2f} MiB"
                for j, (m, p) in enumerate(zip(self.measured, self.predicted))
            )
            + " (measured / predicted)"
        )
        if over:
            warnings.warn(
                f"memory above the prediction by more than {self.tolerance:.0%}: {'; '.join(over)}. A plan "
                "chosen under a budget may not fit it; please report the model and settings",
                PipeckptWarning,
                stacklevel=2,
            )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _optimizer_state_bytes(trainer: L.Trainer) -> dict:
    """Bytes of optimizer state tensors per parameter (by id)."""
    out: dict = {}
    for optimizer in trainer.optimizers:
        for param, state in optimizer.state.items():
            out[id(param)] = out.get(id(param), 0) + sum(
                _nbytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0
            )
    return out
