"""Running a user's unmodified step inside a ``torch.distributed.pipelining`` schedule.

A schedule drives every micro-batch's forward and backward and asks the last stage for a
``loss_fn(output, target)``; a LightningModule computes its loss in ``training_step``. Without
changing the step: the first stage runs it until it calls the Sequential and takes that call's input
(:func:`capture_call`); the last stage runs it again with the Sequential answering the schedule's
output (:func:`answering`); side inputs are captured on each rank, which holds the same batch
(docs/DESIGN.md, engines/distributed/replay).
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from pipeckpt._compat import tree_flatten, tree_unflatten
from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.logs import LogRecorder

__all__: List[str] = []


class Microbatches:
    """The micro-batches of one batch: every tensor leaf split along dim 0."""

    def __init__(self, batch: Any, num_microbatches: int) -> None:
        # A tuple or list of tensors (most batches) is its own leaves, and is rebuilt as one,
        # without the pytree's walk: the batch is cut every step, and rebuilt for every micro-batch
        # on the first and the last stage.
        flat = type(batch) in (tuple, list) and all(isinstance(leaf, Tensor) for leaf in batch)
        self._plain: Optional[type] = type(batch) if flat else None
        leaves, spec = (list(batch), None) if flat else tree_flatten(batch)
        self._spec: Any = spec  # None for a plain tuple or list
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
        size = sizes.pop()
        assert size is not None
        self.size: int = size
        self.count = num_microbatches
        # Split at first use: the first stage takes its micro-batches from the schedule's own split
        # and needs these only for side inputs; the last stage takes every one.
        self._chunks: Optional[List[Tuple[Tensor, ...]]] = None

    @property
    def tensors(self) -> Tuple[Tensor, ...]:
        """The whole batch's tensor leaves, the schedule's input on the first stage."""
        return tuple(self._leaves[i] for i in self._where)

    def signature(self) -> Tuple[Any, ...]:
        return tuple((tuple(t.shape), t.dtype) for t in self.tensors)

    def tensors_of(self, index: int) -> Tuple[Tensor, ...]:
        if self._chunks is None:
            self._chunks = [torch.tensor_split(self._leaves[i], self.count) for i in self._where]
        return tuple(chunks[index] for chunks in self._chunks)

    def rebuild(self, tensors: Sequence[Tensor]) -> Any:
        """A batch of the user's structure around the given tensor leaves."""
        if self._plain is not None:
            return self._plain(tensors)
        leaves = list(self._leaves)
        for i, t in zip(self._where, tensors):
            leaves[i] = t
        return tree_unflatten(leaves, self._spec)

    def __getitem__(self, index: int) -> Any:
        return self.rebuild(self.tensors_of(index))


Call = Tuple[Tuple[Any, ...], Dict[str, Any]]


class _Captured(BaseException):
    """Ends the user's step at its call of the pipelined Sequential (a BaseException,
    so that a step's own ``except Exception`` does not swallow it)."""

    def __init__(self, call: Call) -> None:
        super().__init__()
        self.call = call


class _Instead:
    """Within: ``obj.name`` is ``value`` (an instance attribute), then what it was. Written into the
    instance's ``__dict__``, not through ``nn.Module.__setattr__``, whose checks for parameters,
    modules and buffers a plain function never needs (this runs several times per micro-batch)."""

    __slots__ = ("name", "obj", "previous", "value")

    def __init__(self, obj: Any, name: str, value: Callable[..., Any]) -> None:
        self.obj, self.name, self.value = obj, name, value

    def __enter__(self) -> None:
        own = self.obj.__dict__
        self.previous = own.get(self.name)
        own[self.name] = self.value

    def __exit__(self, *exc: Any) -> None:
        if self.previous is None:
            self.obj.__dict__.pop(self.name, None)
        else:
            self.obj.__dict__[self.name] = self.previous


def _routed(sequential: nn.Module, forward: Callable[..., Any]) -> _Instead:
    """Within: calling ``sequential`` runs ``forward``."""
    return _Instead(sequential, "forward", forward)


def _logging_to(module: LightningModule, log: Callable[..., None]) -> _Instead:
    """Within: ``module.log`` is ``log``."""
    return _Instead(module, "log", log)


def _never_called(module: LightningModule, hook: str) -> Exception:
    return config_error(
        f"{type(module).__name__}.{hook} returned without calling the pipelined Sequential",
        "under the distributed engine every step must call it exactly once",
        "call the Sequential returned by configure_pipeline() in every step",
    )


def _ignore(*args: Any, **kwargs: Any) -> None:
    pass


def capture_call(
    module: LightningModule,
    sequential: nn.Sequential,
    hook: str,
    batch: Any,
    rest: Tuple[Any, ...],
    kwargs: Dict[str, Any],
) -> Call:
    """The arguments the user's ``hook`` passes to the pipelined Sequential for ``batch``.

    The step runs up to that call only; its ``self.log`` calls are dropped here,
    since the last stage runs the whole step and records them."""

    def capture(*args: Any, **kw: Any) -> None:
        raise _Captured((args, kw))

    with _routed(sequential, capture), _logging_to(module, _ignore):
        try:
            getattr(module, hook)(batch, *rest, **kwargs)
        except _Captured as captured:
            return captured.call
    raise _never_called(module, hook)


class _Answer:
    """Stands in for the pipelined Sequential on the last stage: returns the
    schedule's output, once."""

    def __init__(self, output: Any, hook: str) -> None:
        self.output = output
        self.hook = hook
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise config_error(
                f"{self.hook} called the pipelined Sequential {self.calls} times",
                "the distributed engine pipelines one call per step",
                "call it once per step (concatenate inputs along the batch to run several), "
                "or use engine='local'",
            )
        return self.output


class Answering:
    """Within: the user's step sees ``output`` from its Sequential call and logs into ``recorder``.
    A class, not a ``@contextmanager`` generator: it runs once per micro-batch on the last stage."""

    __slots__ = ("answer", "logging", "module", "routed")

    def __init__(
        self,
        module: LightningModule,
        sequential: nn.Sequential,
        output: Any,
        hook: str,
        recorder: LogRecorder,
    ) -> None:
        self.module = module
        self.answer = _Answer(output, hook)
        self.routed = _routed(sequential, self.answer)
        self.logging = _logging_to(module, recorder.log)

    def again(self, output: Any) -> "Answering":
        """The same context for the step's next micro-batch, answering ``output``: made once per
        step rather than once per micro-batch."""
        self.answer.output, self.answer.calls = output, 0
        return self

    def __enter__(self) -> None:
        self.routed.__enter__()
        self.logging.__enter__()

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.logging.__exit__()
        self.routed.__exit__()
        if kind is None and self.answer.calls == 0:
            raise _never_called(self.module, self.answer.hook)


def answering(
    module: LightningModule, sequential: nn.Sequential, output: Any, hook: str, recorder: LogRecorder
) -> Answering:
    """Within: the user's step sees ``output`` from its Sequential call and logs into ``recorder``."""
    return Answering(module, sequential, output, hook, recorder)


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
