"""What the distributed-engine benchmark measures and how (``benchmarks/bench_distributed.py``): the
grid of schedules and micro-batch counts, the MLP's settings and its data, and a ``Trainer`` run
timed step by step (``Measure``), with the bytes autograd saves for backward counted in one more
step (``SavedBytes``).

Apart from the script because other benchmarks time their ``Trainer`` runs the same way:
``bench_zero_bubble.py`` imports ``model_settings`` and ``train``, ``bench_layout_engine_cost.py``
``Measure`` and ``loader`` (from ``bench_distributed``, which re-exports them).
"""

import argparse
import time
from typing import Any, Dict, List, Optional

import lightning as L
import torch
from harness.trainers import QUIET_CPU
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt.app.models import MLP

MICROBATCHES = (2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")


def model_settings(quick: bool) -> Dict[str, int]:
    if quick:
        return dict(in_features=64, hidden=64, depth=4, num_classes=10)
    return dict(in_features=1024, hidden=1024, depth=8, num_classes=10)


def loader(*, batch: int, steps: int, in_features: int, num_classes: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * steps, in_features, generator=g)
    y = torch.randint(0, num_classes, (batch * steps,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


class SavedBytes:
    """Distinct storages autograd holds for backward: live and peak bytes."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters() if not p.is_meta}
        self._refs: Dict[int, List[int]] = {}
        self.live = 0
        self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or key == 0:
            return t
        refs = self._refs.get(key)
        if refs is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            refs[0] += 1
        return _Held(self, key, t)

    def _unpack(self, held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        refs = self._refs[key]
        refs[0] -= 1
        if refs[0] == 0:
            self.live -= refs[1]
            del self._refs[key]


class _Held:
    def __init__(self, counter: SavedBytes, key: int, tensor: torch.Tensor) -> None:
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        self.counter.release(self.key)


class Measure(Callback):
    """Times the optimizer steps after `warmup`, then counts saved bytes in one more step."""

    def __init__(self, warmup: int, timed: int) -> None:
        self.warmup, self.timed = warmup, timed
        self.starts: List[float] = []
        self.batches = 0
        self._hooks: Any = None
        self.counter: Optional[SavedBytes] = None

    def on_train_batch_start(
        self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        if idx % trainer.accumulate_grad_batches == 0:
            self.starts.append(time.perf_counter())
        if len(self.starts) == self.warmup + self.timed + 1 and self._hooks is None:
            self.counter = SavedBytes(module)
            self._hooks = self.counter.hooks()
            self._hooks.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self._hooks is not None and (args[-1] + 1) % trainer.accumulate_grad_batches == 0:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def seconds_per_step(self) -> float:
        return (self.starts[self.warmup + self.timed] - self.starts[self.warmup]) / self.timed


def train(
    strategy: Any,
    *,
    devices: int,
    batch: int,
    accumulate: int,
    args: argparse.Namespace,
    model: Dict[str, int],
) -> Measure:
    steps = args.warmup + args.timed + 1
    measure = Measure(args.warmup, args.timed)
    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy=strategy,
        devices=devices,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[measure],
        **QUIET_CPU,
    )
    data = loader(
        batch=batch,
        steps=steps * accumulate,
        in_features=model["in_features"],
        num_classes=model["num_classes"],
    )
    trainer.fit(MLP(**model), data)
    return measure
