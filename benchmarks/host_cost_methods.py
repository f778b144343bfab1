"""The three runs the host-cost benchmark compares (``benchmarks/bench_host_cost.py``): the
hand-written pipelining script (``raw``), that script inside Lightning's loop (``lightning``) and the
distributed engine through a ``Trainer`` (``pipeckpt``), with the proxy model and data they share.

Apart from the script because they are what is measured, each a whole training run of one rank;
the script only starts the ranks, orders the rounds and writes the report.
"""

from typing import Any, Dict, List, Tuple

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness.trainers import QUIET_CPU
from host_cost_clock import Clock
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy

METHODS = ("raw", "lightning", "pipeckpt")


class Proxy(L.LightningModule):
    """``depth`` x ``Linear(width, width)``, MSE against a target, AdamW."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(spec: Dict[str, Any], steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    batch, width = spec["batch"], spec["width"]
    x = torch.randn(batch * steps, width, generator=g)
    y = torch.randn(batch * steps, width, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def half_schedule(layers: nn.Sequential, m: int) -> Tuple[nn.Sequential, Schedule1F1B]:
    """This rank's half of ``layers`` and the hand-written 1F1B schedule over it (``m`` micro-batches,
    each micro-batch's loss divided by ``m``), as the raw script and Lightning + raw both run it."""
    rank = dist.get_rank()
    half = len(layers) // 2
    part = layers[:half] if rank == 0 else layers[half:]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    return part, Schedule1F1B(stage, m, loss_fn=lambda out, y: F.mse_loss(out, y) / m, scale_grads=False)


def step_loss(losses: List[Tensor], m: int) -> Tensor:
    """The step's mean loss from the schedule's per-micro-batch losses (each divided by ``m``)."""
    return torch.stack([loss.detach() * m for loss in losses]).mean()


def raw(spec: Dict[str, Any]) -> Tuple[Dict[str, float], List[float], List[Tensor]]:
    """The hand-written script: per-step times, the mean loss of each step (last rank) and the weights."""
    warmup, timed, m = spec["warmup"], spec["timed"], spec["chunks"]
    rank = dist.get_rank()
    torch.manual_seed(0)
    part, schedule = half_schedule(Proxy(spec["depth"], spec["width"]).layers, m)
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-3)
    clock, losses = Clock(spec), []
    step = clock.timed(schedule.step)
    for x, y in loader(spec, warmup + timed + 1):
        clock.tick()
        optimizer.zero_grad()
        if rank == 0:
            step(x)
        else:
            out: List[Tensor] = []
            step(target=y, losses=out)
            losses.append(step_loss(out, m).item())
        optimizer.step()
    clock.tick()
    return clock.per_step(), losses, [p.detach().clone() for p in part.parameters()]


class _HandWritten(Proxy):
    """The raw script's stage and schedule, run in ``training_step``, which zeroes the gradients
    first as the script does: Lightning's own zeroing (between ``training_step`` and ``backward``)
    and its ``backward`` do nothing, as the schedule ran the backward. Each process is a one-device
    Trainer of its own half."""

    def __init__(self, spec: Dict[str, Any], clock: Clock) -> None:
        super().__init__(spec["depth"], spec["width"])
        m = spec["chunks"]
        part, schedule = half_schedule(self.layers, m)
        self.rank, self.chunks, self.part = dist.get_rank(), m, [part]
        self.step = clock.timed(schedule.step)

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.optimizer.zero_grad()
        if self.rank == 0:
            self.step(x)
            return torch.zeros(())
        out: List[Tensor] = []
        self.step(target=y, losses=out)
        return step_loss(out, self.chunks)

    def optimizer_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        pass

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.optimizer = torch.optim.AdamW(self.part[0].parameters(), lr=1e-3)
        return self.optimizer


def lightning(spec: Dict[str, Any]) -> Tuple[Dict[str, float], List[float], List[Tensor]]:
    """The raw script's schedule inside Lightning's loop."""
    warmup, timed = spec["warmup"], spec["timed"]
    clock = Clock(spec)
    measure = _Measure(clock, engine=False)
    torch.manual_seed(0)
    module = _HandWritten(spec, clock)
    trainer = L.Trainer(devices=1, max_steps=warmup + timed + 1, callbacks=[measure], **QUIET_CPU)
    trainer.fit(module, loader(spec, warmup + timed + 1))
    weights = [p.detach().clone() for p in module.part[0].parameters()]
    return clock.per_step(), measure.losses, weights


class _Measure(Callback):
    def __init__(self, clock: Clock, engine: bool = True) -> None:
        self.clock, self.engine = clock, engine
        self.losses: List[float] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not self.engine:
            return
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        engine.run = self.clock.timed(engine.run)
        engine.take_step_gradients = self.clock.timed(engine.take_step_gradients)

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.tick()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, *args: Any) -> None:
        self.clock.tick()


def pipeckpt(spec: Dict[str, Any]) -> Tuple[Dict[str, float], List[float], List[Tensor]]:
    """The same work through a Trainer and the distributed engine."""
    warmup, timed = spec["warmup"], spec["timed"]
    clock = Clock(spec)
    measure = _Measure(clock)
    torch.manual_seed(0)
    module = Proxy(spec["depth"], spec["width"])
    half = spec["depth"] // 2
    strategy = PipelineStrategy(
        engine="distributed", balance=[half, half], chunks=spec["chunks"], schedule="1f1b", checkpoint="never"
    )
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        max_steps=warmup + timed + 1,
        callbacks=[measure],
        **QUIET_CPU,
    )
    trainer.fit(module, loader(spec, warmup + timed + 1))
    layers = module.layers
    part = layers[:half] if dist.get_rank() == 0 else layers[half:]
    return clock.per_step(), measure.losses, [p.detach().clone() for p in part.parameters()]
