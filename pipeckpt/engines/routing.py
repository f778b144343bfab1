"""Running a user's unmodified step inside a ``torch.distributed.pipelining`` schedule.

A schedule drives forward and backward of every micro-batch itself and asks
the last stage for a ``loss_fn(output, target)``; a LightningModule computes its
loss in ``training_step``, around its own call of the pipelined Sequential.
This module bridges the two without changing the step:

- first stage: the step runs on one micro-batch of the batch until it calls the
  Sequential; the call is aborted there and its input becomes the micro-batch's
  pipeline input (:func:`capture_input`);
- last stage: the step runs again on the micro-batch with the Sequential
  answering the schedule's output for it (:func:`answering`); its loss is the
  micro-batch loss;
- ``self.log`` calls are recorded (:class:`LogRecorder`), reduced over the
  micro-batches, and replayed once per step on every rank of the pipeline, so
  that the loggers of global rank 0 see what the last stage computed.

A micro-batch is the same slice of every tensor in the batch (dim 0), cut by
the same ``tensor_split`` as the schedule cuts the pipeline input.
"""

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from pipeckpt._compat import tree_flatten, tree_unflatten
from pipeckpt._errors import config_error

__all__: List[str] = []


class Microbatches:
    """The micro-batches of one batch: every tensor leaf split along dim 0."""

    def __init__(self, batch: Any, num_microbatches: int) -> None:
        leaves, self._spec = tree_flatten(batch)
        self._leaves: List[Any] = leaves
        self._where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        if not self._where:
            raise config_error(
                f"a batch of type {type(batch).__name__} without tensors",
                "the distributed engine splits the batch's tensors into micro-batches",
                "return tensors (or tuples/dicts of tensors) from your DataLoader",
            )
        sizes = {leaves[i].size(0) if leaves[i].dim() else None for i in self._where}
        if len(sizes) != 1 or None in sizes:
            raise config_error(
                f"a batch whose tensors have first dimensions {sorted(map(str, sizes))}",
                "every tensor in the batch must have the samples along dim 0, in the same number",
                "keep per-batch constants out of the batch, or give them a batch dimension",
            )
        self.size: int = sizes.pop()
        self.count = num_microbatches
        self._chunks = [torch.tensor_split(leaves[i], num_microbatches) for i in self._where]

    @property
    def tensors(self) -> Tuple[Tensor, ...]:
        """The whole batch's tensor leaves, the schedule's input on the first stage."""
        return tuple(self._leaves[i] for i in self._where)

    def signature(self) -> Tuple[Any, ...]:
        return tuple((tuple(t.shape), t.dtype) for t in self.tensors)

    def tensors_of(self, index: int) -> Tuple[Tensor, ...]:
        return tuple(chunks[index] for chunks in self._chunks)

    def rebuild(self, tensors: Sequence[Tensor]) -> Any:
        """A batch of the user's structure around the given tensor leaves."""
        leaves = list(self._leaves)
        for i, t in zip(self._where, tensors):
            leaves[i] = t
        return tree_unflatten(leaves, self._spec)

    def __getitem__(self, index: int) -> Any:
        return self.rebuild(self.tensors_of(index))


class _Captured(BaseException):
    """Ends the user's step at its call of the pipelined Sequential (a BaseException,
    so that a step's own ``except Exception`` does not swallow it)."""

    def __init__(self, input: Tensor) -> None:
        super().__init__()
        self.input = input


def _single_tensor(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tensor:
    if kwargs or len(args) != 1 or not isinstance(args[0], Tensor):
        raise config_error(
            "the pipelined Sequential was called with "
            f"{len(args)} positional and {len(kwargs)} keyword arguments",
            "a pipeline passes one tensor from stage to stage",
            "call it with one tensor",
        )
    return args[0]


@contextmanager
def _routed(sequential: nn.Sequential, forward: Callable[..., Any]) -> Iterator[None]:
    previous = sequential.__dict__.get("forward")
    sequential.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            sequential.__dict__.pop("forward", None)
        else:
            sequential.forward = previous  # type: ignore[method-assign]


@contextmanager
def _logging_to(module: LightningModule, log: Callable[..., None]) -> Iterator[None]:
    module.log = log  # type: ignore[method-assign]
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


def _ignore(*args: Any, **kwargs: Any) -> None:
    pass


def capture_input(
    module: LightningModule,
    sequential: nn.Sequential,
    hook: str,
    batch: Any,
    rest: Tuple[Any, ...],
    kwargs: Dict[str, Any],
) -> Tensor:
    """The input the user's ``hook`` passes to the pipelined Sequential for ``batch``.

    The step runs up to that call only; its ``self.log`` calls are dropped here,
    since the last stage runs the whole step and records them."""

    def capture(*args: Any, **kw: Any) -> Tensor:
        raise _Captured(_single_tensor(args, kw))

    with _routed(sequential, capture), _logging_to(module, _ignore):
        try:
            getattr(module, hook)(batch, *rest, **kwargs)
        except _Captured as captured:
            return captured.input
    raise config_error(
        f"{type(module).__name__}.{hook} returned without calling the pipelined Sequential",
        "under the distributed engine every step must call it exactly once",
        "call the Sequential returned by configure_pipeline() in every step",
    )


class _Answer:
    """Stands in for the pipelined Sequential on the last stage: returns the
    schedule's output, once."""

    def __init__(self, output: Any, hook: str) -> None:
        self.output = output
        self.hook = hook
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _single_tensor(args, kwargs)
        self.calls += 1
        if self.calls > 1:
            raise config_error(
                f"{self.hook} called the pipelined Sequential {self.calls} times",
                "the distributed engine pipelines one call per step",
                "call it once per step (concatenate inputs along the batch to run several), "
                "or use engine='local'",
            )
        return self.output


@contextmanager
def answering(
    module: LightningModule, sequential: nn.Sequential, output: Any, hook: str, recorder: "LogRecorder"
) -> Iterator[None]:
    """Within: the user's step sees ``output`` from its Sequential call and logs into ``recorder``."""
    answer = _Answer(output, hook)
    with _routed(sequential, answer), _logging_to(module, recorder.log):
        yield
    if answer.calls == 0:
        raise config_error(
            f"{type(module).__name__}.{hook} returned without calling the pipelined Sequential",
            "under the distributed engine every step must call it exactly once",
            "call the Sequential returned by configure_pipeline() in every step",
        )


def step_loss(output: Any, hook: str) -> Tensor:
    """The loss in what a training step returned (a tensor, or a dict with ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise config_error(
            f"training_step returned {type(output).__name__}",
            "the distributed engine needs a loss from every micro-batch, so a step cannot be "
            "skipped by returning None",
            "return the loss tensor (or a dict with a 'loss' tensor)",
        )
    return loss


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
                options["batch_size"] = sum(series.batch_sizes)  # type: ignore[arg-type]
            out.append((name, value.cpu(), options))
        return out


def replay(
    module: LightningModule, records: Sequence[Tuple[str, Tensor, Dict[str, Any]]], device: torch.device
) -> None:
    """Logs reduced records on this rank, as the user's step would have."""
    for name, value, options in records:
        module.log(name, value.to(device), **options)
