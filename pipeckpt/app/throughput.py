"""Training throughput: tokens per second in total and per device, and the model FLOPs utilisation
(MFU) where the model's FLOPs per token and the device's peak are known, on the progress bar and in
the logger, and over the whole run for train.py's summary line.

Why not Lightning's ``ThroughputMonitor`` as it is: it multiplies one process's rate by the world
size, which under ``strategy=pipe`` with the distributed engine counts every batch once per pipeline
stage (the stages of one pipeline all read the same batch); it writes to the logger only, and it
needs the FLOPs of a whole batch from a module whose process may hold one stage. This callback keeps
Lightning's :class:`~lightning.fabric.utilities.throughput.Throughput` for the rolling rates and
:func:`~lightning.fabric.utilities.throughput.get_available_flops` for a device's peak, and counts a
batch once per data-parallel replica: ``num_replicas`` of the strategy's
``distributed_sampler_kwargs`` (1 for a pipeline's replica, the world size under DDP, 1 without).

What is counted, per batch a replica reads:

- tokens: ``input_ids.numel()`` of a Hugging Face batch (a dict), every position the model reads:
  packed windows have no padding, and where a batch is padded the pads are read (and counted) too,
  whatever its attention mask or its labels of -100 say; ``x.numel()`` of an ``(x, y)`` batch whose
  ``x`` holds integer token ids (the app's GPT and Llama);
- samples: the batch size (Lightning's ``extract_batch_size``), for data without tokens (the app's
  synthetic images and vectors), whose rates are given in samples per second instead.

Per device is the total over every device of the run: the processes (one device each) under the
distributed engine and DDP, or the distinct devices of the stages under the local engine (one for
all stages on the CPU). MFU is ``tokens/s x flops_per_token / (devices x peak)``, with the module's
``flops_per_token`` (:func:`model_flops_per_token`'s 6N for the app's models; a module without one
gets no MFU) and the peak of one device for the run's precision from Lightning's table, which knows
CUDA and TPU chips: on a CPU it has none, so no MFU is logged there (tokens/s are), unless
``peak_flops`` gives it.
"""

from time import perf_counter
from typing import Any, Dict, Mapping, NamedTuple, Optional

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor, nn

from pipeckpt._errors import config_error
from pipeckpt.strategy import PipelineStrategy

__all__ = ["ThroughputLog", "batch_tokens", "model_flops_per_token"]

#: The compute dtype of each of Lightning's precision settings (float32 for any other).
_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "64-true": torch.float64,
}


def model_flops_per_token(model: nn.Module) -> int:
    """FLOPs of one token's forward and backward pass: 6 x the parameters outside embedding tables
    (the rule of transformers' ``Trainer.floating_point_ops``; attention's own products, which grow
    with the sequence, are left out). A head tied to the embedding counts once, as the head."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return 6 * total


def batch_tokens(batch: Any) -> Optional[int]:
    """The tokens the model reads in ``batch`` (the module docstring says which), or None for data
    without tokens."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        return int(ids.numel()) if isinstance(ids, Tensor) else None
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        x = batch[0]
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            return None
        return int(x.numel())
    return None


class Point(NamedTuple):
    """The run after one batch: training seconds (validation left out), and samples and tokens read
    by all replicas (tokens None for data without them)."""

    seconds: float
    samples: int
    tokens: Optional[int]


def _devices(trainer: L.Trainer) -> int:
    strategy = trainer.strategy
    if isinstance(strategy, PipelineStrategy) and not strategy.is_distributed and strategy.plan is not None:
        return len(set(strategy.plan.devices))  # the local engine: one process drives every stage
    return trainer.world_size


def _replicas(trainer: L.Trainer) -> int:
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    return int(kwargs.get("num_replicas", 1)) if isinstance(kwargs, dict) else 1


class ThroughputLog(L.Callback):
    """Logs ``tokens_per_sec``, ``tokens_per_sec_per_device`` and ``mfu`` (where known; all three on
    the progress bar) and ``tokens`` (read so far) after each training batch, or ``samples_per_sec``,
    ``samples_per_sec_per_device`` and ``samples`` for data without tokens. The rates are rolling,
    over the last ``window`` batches (none before ``window`` batches); :meth:`summary` gives the
    whole run's.

    Args:
        window: batches per rolling rate, at least 2.
        peak_flops: one device's peak FLOP/s; None takes Lightning's figure for the device and the
            run's precision (none for a CPU: no MFU).
    """

    def __init__(self, window: int = 10, peak_flops: Optional[float] = None) -> None:
        if window < 2:
            raise config_error(
                f"callbacks.throughput.window={window}",
                "a rate is measured between two batches at least",
                "set callbacks.throughput.window to 2 or more",
            )
        if peak_flops is not None and not peak_flops > 0:
            raise config_error(
                f"callbacks.throughput.peak_flops={peak_flops}",
                "a device's peak FLOP/s is positive",
                "give the device's peak FLOP/s for the run's precision, or null for Lightning's table",
            )
        self.window, self.peak_flops = window, peak_flops
        self.replicas, self.devices = 1, 1
        self.peak: Optional[float] = None  # the one used: peak_flops, or Lightning's figure
        self.flops_per_token: Optional[float] = None
        self.first: Optional[Point] = None  # after the first batch, whose one-time costs no rate includes
        self.last: Optional[Point] = None
        self._throughput = Throughput(window_size=window)
        self._batches = 0
        self._start: Optional[float] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.replicas, self.devices = _replicas(trainer), _devices(trainer)
        dtype = _DTYPES.get(str(trainer.precision), torch.float32)
        self.peak = self.peak_flops or get_available_flops(trainer.strategy.root_device, dtype)
        flops = getattr(pl_module, "flops_per_token", None)
        self.flops_per_token = float(flops) if isinstance(flops, (int, float)) and flops > 0 else None
        self._throughput.reset()
        self.first = self.last = None
        self._batches = 0
        self._start = perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is not None and self.last is not None and not trainer.sanity_checking:
            # Training resumes where its last batch ended: validation is no training time.
            self._start = perf_counter() - self.last.seconds

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's kernels are part of its time
        samples, tokens = extract_batch_size(batch), batch_tokens(batch)
        last = self.last or Point(0.0, 0, 0)
        total_tokens = None if tokens is None or last.tokens is None else last.tokens + tokens * self.replicas
        self.last = Point(perf_counter() - self._start, last.samples + samples * self.replicas, total_tokens)
        self.first = self.first or self.last
        self._batches += 1
        self._throughput.update(
            time=self.last.seconds,
            batches=self._batches,
            samples=self.last.samples,
            lengths=self.last.tokens,
        )
        self._log(pl_module, samples)

    def _rates(self, rate: float, kind: str) -> Dict[str, float]:
        rates = {f"{kind}_per_sec": rate, f"{kind}_per_sec_per_device": rate / self.devices}
        if kind == "tokens" and self.flops_per_token is not None and self.peak:
            rates["mfu"] = rate * self.flops_per_token / (self.devices * self.peak)
        return rates

    def _log(self, pl_module: L.LightningModule, batch_size: int) -> None:
        assert self.last is not None
        kind = "samples" if self.last.tokens is None else "tokens"
        rolling = self._throughput.compute().get(f"device/{'items' if kind == 'tokens' else kind}_per_sec")
        count = self.last.samples if self.last.tokens is None else self.last.tokens
        options: Dict[str, Any] = dict(on_step=True, on_epoch=False, batch_size=batch_size)
        pl_module.log(kind, torch.tensor(count, dtype=torch.float64), **options)
        if rolling is not None:
            for name, value in self._rates(rolling, kind).items():
                pl_module.log(name, value, prog_bar=True, **options)

    def summary(self) -> Dict[str, float]:
        """The run's rates (``tokens_per_sec``, ``tokens_per_sec_per_device``, ``mfu``, or those of
        samples) from its first batch's end to its last (from training's start after one batch
        only); empty before any batch."""
        if self.last is None or self.first is None:
            return {}
        start = self.first if self.first is not self.last else Point(0.0, 0, 0)
        seconds = self.last.seconds - start.seconds
        if self.last.tokens is not None and start.tokens is not None:
            return self._rates((self.last.tokens - start.tokens) / seconds, "tokens")
        return self._rates((self.last.samples - start.samples) / seconds, "samples")
