"""Gradients set aside while other work runs a backward of its own.

Two places need it: torchgpipe's profiler (balance by time or memory) refuses
parameters that already hold gradients, and the distributed engine's schedule
runs backward inside ``training_step``, before Lightning zeroes ``.grad`` (the
zeroing comes between ``training_step`` and ``backward``): the step's gradients
wait aside until the strategy's backward. Holding the previous gradients aside
meanwhile would cost a whole extra copy of them at the schedule's peak, so a
caller that knows they are about to be zeroed (the first batch of an
accumulation window) drops them instead (:func:`window_starts` decides).
"""

from typing import Any, Collection, Iterable, List, Optional, Tuple

from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn

__all__ = ["gradients_set_aside", "window_starts", "zeroed_by_lightning", "zeroes_its_own_way"]


class GradientsAside:
    """The context of :func:`gradients_set_aside`: a class, not ``@contextmanager``, since the
    distributed engine enters it every step and a generator-based context costs several Python
    calls a use."""

    __slots__ = ("computed", "drop", "held", "params")

    def __init__(self, params: Iterable[nn.Parameter], drop: Collection[nn.Parameter]) -> None:
        self.params, self.drop = list(params), drop
        self.held: List[Optional[Tensor]] = []
        self.computed: List[Tuple[nn.Parameter, Tensor]] = []

    def __enter__(self) -> List[Tuple[nn.Parameter, Tensor]]:
        params = self.params
        if self.drop:
            dropped = {id(p) for p in self.drop}
            self.held = [None if id(p) in dropped else p.grad for p in params]
        else:
            self.held = [p.grad for p in params]
        for p in params:
            p.grad = None
        return self.computed

    def __exit__(self, *exc: Any) -> None:
        self.computed.extend([(p, p.grad) for p in self.params if p.grad is not None])
        for p, g in zip(self.params, self.held):
            p.grad = g


def gradients_set_aside(
    params: Iterable[nn.Parameter], *, drop: Collection[nn.Parameter] = ()
) -> GradientsAside:
    """Within: every parameter of ``params`` starts with no gradient. After: each has its
    old gradient back, except those of ``drop``, whose old gradient is gone (``None``) from the
    start; the list it yields holds ``(parameter, gradient)`` for the gradients computed within."""
    return GradientsAside(params, drop)


def window_starts(trainer: Trainer) -> bool:
    """Whether the batch now running is the first of an accumulation window: the one before
    whose backward Lightning's automatic optimization zeroes the gradients. Hand-written because
    no public API tells: Lightning's rule, from ``_AutomaticOptimization._make_zero_grad_fn``, is
    ``batch_idx % accumulate_grad_batches == 0``, with the epoch loop's public ``batch_idx``
    already counting this batch when ``training_step`` runs."""
    return trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0


def zeroed_by_lightning(module: LightningModule) -> List[nn.Parameter]:
    """The parameters Lightning zeroes at a window's first batch: its optimizers' parameters,
    when the module keeps Lightning's own ``optimizer_zero_grad`` (an override may zero
    otherwise, or not at all: then none is known to be zeroed)."""
    if zeroes_its_own_way(module):
        return []
    return [p for opt in module.trainer.optimizers for group in opt.param_groups for p in group["params"]]


def zeroes_its_own_way(module: LightningModule) -> bool:
    """Whether ``module`` overrides Lightning's ``optimizer_zero_grad``."""
    return type(module).optimizer_zero_grad is not LightningModule.optimizer_zero_grad
