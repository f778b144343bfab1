"""What a zero-bubble schedule's split backward costs a stage: its input pass and its weight pass,
against one whole backward.

Why apart, and measured: a zero-bubble schedule runs a micro-batch's backward as an input pass,
which the previous stage waits for, and a weight pass, which fills the bubbles. The cost model had
priced each at half the backward. On this project's 2-core Xeon (2026-12-03, one thread), the
engine's split (:func:`pipeckpt.stages.weight_pass.input_pass`) of two transformer encoder layers
(d 256, seq 128) took 1.20-1.25x the whole backward, the input pass 0.70-0.83 of it: the input pass
holds every gradient that is not a weight's (attention's products, the norms, the softmax), and
the graph is walked twice; the app's GPT mini's own layers, 1.04-1.16x with 0.55-0.60 in the
input pass. Priced at halves, the search ranked a V-shaped zero-bubble layout of that GPT first on
2 and on 4 processes; priced as timed, 4th and 17th (benchmarks/RESULTS_layout.md, 2026-12-03).

The first stage does not split, whatever the measurement: its input takes no gradient (token ids),
so its input pass has nothing to make and its weight pass makes everything (``input_pass`` with no
``wrt``), :meth:`SplitBackward.at`. A ``pipeline_of`` model's stages split as a Sequential's do:
the schedules' weight passes add its layers' gradients (tests/engines/distributed/
test_distributed_zero_bubble.py, the rooted model), so its split is measured on the chain the
profile runs (pipeckpt/plan_model.py ``split_timed``). Until 2026-12-06 the search priced it
:data:`WHOLE`, as an engine flag (``whole_backward``) said, which the split schedules override.
"""

import statistics
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from pipeckpt._compat import accumulate_gradients, tree_flatten
from pipeckpt.memory.timing import clock
from pipeckpt.stages.weight_pass import input_pass

__all__ = ["HALVES", "SplitBackward", "WHOLE", "from_flops", "measured"]


@dataclass(frozen=True)
class SplitBackward:
    """A split backward as shares of one whole backward's seconds.

    Args:
        input_share: of the split's seconds, the input pass's.
        factor: the split's seconds (both passes) over one whole backward's.
        splits: whether the stages split at all (False: the input pass is the whole backward).
    """

    input_share: float = 0.5
    factor: float = 1.0
    splits: bool = True

    def at(self, backward: float, *, first: bool) -> Tuple[float, float]:
        """The input and weight passes' seconds of a stage whose whole backward takes ``backward``;
        ``first``: the pipeline's first stage, whose input needs no gradient."""
        if not self.splits:
            return backward, 0.0
        if first:
            return 0.0, backward
        both = backward * self.factor
        return both * self.input_share, both * (1.0 - self.input_share)


#: Each pass half the backward: where nothing was counted or timed.
HALVES = SplitBackward()

#: A stage that makes every gradient in its input pass.
WHOLE = SplitBackward(input_share=1.0, factor=1.0, splits=False)


def from_flops(dense: float, attention: float) -> SplitBackward:
    """The split of a transformer layer counted in FLOPs: a matmul's input gradient costs its
    forward and so does its weight gradient; attention's products (``attention`` forward FLOPs:
    the scores and their product with the values) have no weights, so both of their gradients are
    the input pass's. The split itself costs nothing more (an accelerator's kernels dwarf the walk
    of the graph: Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, price B + W as the
    whole backward)."""
    whole = 2 * dense + 2 * attention
    return SplitBackward(input_share=(dense + 2 * attention) / whole if whole > 0 else 0.5)


def measured(
    layers: Sequence[nn.Module],
    x: Any,
    loss_fn: Optional[Callable[..., Any]] = None,
    target: Any = None,
    rounds: int = 3,
) -> Optional[SplitBackward]:
    """The split of ``layers`` after the first (whose input takes no gradient) and the loss
    (``loss_fn(output, target)``; without it, backward starts from ones), run on ``x`` as the
    engine splits a stage's backward, timed against the whole backward on the profile's clock,
    interleaved, medians over ``rounds`` after a warm-up; None where the first layer's output is not
    one floating tensor. The parameters' gradients are left as found."""
    with torch.no_grad():
        start = layers[0](x) if layers else None
    if not isinstance(start, Tensor) or not start.is_floating_point():
        return None
    after = [] if loss_fn is None else [lambda out: loss_fn(out, target)]
    modules: List[Callable[[Any], Any]] = [*layers[1:], *after]
    params = [p for m in layers[1:] for p in m.parameters() if p.requires_grad]
    kept = [p.grad for p in params]
    tick = clock()
    samples: List[Tuple[float, float, float]] = []
    try:
        for r in range(rounds + 1):
            whole = _timed(modules, start, params, tick, split=False)
            inputs, weights = _timed(modules, start, params, tick, split=True)
            if r > 0:
                samples.append((whole, inputs, weights))
    finally:
        for p, g in zip(params, kept):
            p.grad = g
    whole = statistics.median(w for w, _, _ in samples)
    inputs = statistics.median(i for _, i, _ in samples)
    weights = statistics.median(w for _, _, w in samples)
    if whole <= 0 or inputs + weights <= 0:
        return None
    return SplitBackward(input_share=inputs / (inputs + weights), factor=(inputs + weights) / whole)


def _timed(
    modules: List[Callable[[Any], Any]], start: Tensor, params: Sequence[Tensor], tick: Any, *, split: bool
) -> Any:
    """One forward from ``start``, then its backward whole (its seconds) or split (the input and
    the weight pass's seconds)."""
    h: Any = start.detach().requires_grad_()
    first = h
    for m in modules:
        h = m(h)
    outputs = [t for t in tree_flatten(h)[0] if isinstance(t, Tensor) and t.requires_grad]
    edges = [get_gradient_edge(t) for t in outputs]
    grads = [torch.ones_like(t) for t in outputs]
    del h, outputs
    for p in params:
        p.grad = None
    t0 = tick()
    if not split:
        accumulate_gradients(edges, grads, [first, *params])
        return tick() - t0
    weight_pass = input_pass(edges, grads, [first], params)
    t1 = tick()
    if weight_pass is not None:
        weight_pass()
    return t1 - t0, tick() - t1
