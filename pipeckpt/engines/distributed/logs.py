"""``self.log`` in a step that runs once per micro-batch, reduced to one call per step.

The last stage runs the user's step once per micro-batch; its ``self.log`` calls
are recorded (:class:`LogRecorder`), reduced over the micro-batches as one call
on the whole batch would have logged, sent to every rank of the pipeline and
replayed there (:func:`replay`), so that the loggers of global rank 0 see what
the last stage computed.
"""

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from pipeckpt._errors import config_error

__all__: List[str] = []

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_REDUCTIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "mean": torch.mean,
    "sum": torch.sum,
    "max": torch.max,
    "min": torch.min,
}
_NAMED = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


@dataclass
class _Series:
    values: List[Tensor] = field(default_factory=list)
    options: Dict[str, Any] = field(default_factory=dict)
    batch_sizes: List[Optional[int]] = field(default_factory=list)


class LogRecorder:
    """Collects ``self.log`` calls of the micro-batch steps and reduces them to one
    call per name, as a step on the whole batch would have made."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self._series: Dict[str, _Series] = {}

    def log(self, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        options.pop("self")
        name, value = options.pop("name"), options.pop("value")
        if isinstance(value, (int, float)):
            value = torch.tensor(float(value))
        if not isinstance(value, Tensor) or value.numel() != 1:
            raise config_error(
                f"self.log({name!r}, <{type(value).__name__}>) in {self.hook}",
                "the distributed engine reduces logged values over micro-batches and sends them "
                "to rank 0, which needs a number or a one-element tensor",
                "log a number or tensor (for a torchmetrics Metric, log metric.compute() at epoch end)",
            )
        if options["sync_dist_group"] is not None:
            raise config_error(
                f"self.log({name!r}, sync_dist_group=...) in {self.hook}",
                "the process groups of the distributed engine are its own",
                "use sync_dist=True without a group",
            )
        fx = options["reduce_fx"]
        options["reduce_fx"] = _NAMED.get(fx, fx)
        series = self._series.setdefault(name, _Series(options=options))
        series.values.append(value.detach().float().reshape(()))
        series.batch_sizes.append(options.pop("batch_size"))

    def reduced(self) -> List[Tuple[str, Tensor, Dict[str, Any]]]:
        """One ``(name, value, log options)`` per name, on the CPU, ready to send."""
        out = []
        for name, series in self._series.items():
            options = dict(series.options)
            fx = options["reduce_fx"]
            stacked = torch.stack(series.values)
            if isinstance(fx, str) and fx in _REDUCTIONS:
                value = _REDUCTIONS[fx](stacked)
            elif callable(fx):
                value, options["reduce_fx"] = fx(stacked), "mean"
            else:
                value = stacked.mean()
            if all(b is not None for b in series.batch_sizes):
                options["batch_size"] = sum(b for b in series.batch_sizes if b is not None)
            out.append((name, value.cpu(), options))
        return out


def replay(
    module: LightningModule, records: Sequence[Tuple[str, Tensor, Dict[str, Any]]], device: torch.device
) -> None:
    """Logs reduced records on this rank, as the user's step would have."""
    for name, value, options in records:
        module.log(name, value.to(device), **options)
