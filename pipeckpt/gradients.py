"""Gradients set aside while other work runs a backward of its own.

Two places need it: torchgpipe's profiler (balance by time or memory) refuses
parameters that already hold gradients, and the distributed engine's schedule
runs backward inside ``training_step``, where Lightning has not yet zeroed the
previous step's gradients (accumulation) and then zeroes them before
``backward``: the step's gradients wait aside until the strategy's backward.
"""

from contextlib import contextmanager
from typing import Iterable, Iterator, List, Tuple

from torch import Tensor, nn

__all__ = ["gradients_set_aside"]


@contextmanager
def gradients_set_aside(params: Iterable[nn.Parameter]) -> Iterator[List[Tuple[nn.Parameter, Tensor]]]:
    """Within: every parameter of ``params`` starts with no gradient. After: each has its
    old gradient back, and the yielded list holds ``(parameter, gradient)`` for the
    gradients computed within."""
    params = list(params)
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    computed: List[Tuple[nn.Parameter, Tensor]] = []
    try:
        yield computed
    finally:
        computed.extend((p, p.grad) for p in params if p.grad is not None)
        for p, g in zip(params, held):
            p.grad = g
