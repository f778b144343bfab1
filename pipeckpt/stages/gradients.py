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

from contextlib import contextmanager
from typing import Collection, Iterable, Iterator, List, Tuple

from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn

__all__ = ["gradients_set_aside", "window_starts", "zeroed_by_lightning", "zeroes_its_own_way"]


@contextmanager
def gradients_set_aside(
    params: Iterable[nn.Parameter], *, drop: Collection[nn.Parameter] = ()
) -> Iterator[List[Tuple[nn.Parameter, Tensor]]]:
    """Within: every parameter of ``params`` starts with no gradient. After: each has its
    old gradient back, except those of ``drop``, whose old gradient is gone (``None``) from the
    start; the yielded list holds ``(parameter, gradient)`` for the gradients computed within."""
    params = list(params)
    if drop:
        dropped = {id(p) for p in drop}
        held = [None if id(p) in dropped else p.grad for p in params]
    else:
        held = [p.grad for p in params]
    for p in params:
        p.grad = None
    computed: List[Tuple[nn.Parameter, Tensor]] = []
    try:
        yield computed
    finally:
        computed.extend([(p, p.grad) for p in params if p.grad is not None])
        for p, g in zip(params, held):
            p.grad = g


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
