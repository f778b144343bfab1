"""A stage Function's backward split in two: input gradients now, weight gradients later.

Zero-bubble schedules run a micro-batch's backward as an input pass, which the previous stage
waits for, and a weight pass, which fills the bubbles. A stage's micro-batch is one autograd
Function (:mod:`pipeckpt.stages.recompute`), opaque to torch's own split, so the split happens
inside its backward, on the graph it recomputed or kept: as torch's ``stage_backward_input``
does, the input pass records the gradients reaching the nodes where the weights' paths join the
input's, and the weight pass starts from those nodes. One recompute serves both passes; the
graph stays alive in between (docs/DESIGN.md, stages/weight_pass).
"""

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pipeckpt._compat import accumulate_gradients, accumulate_keeping_graph, param_groups, reverse_graph

__all__ = ["WeightPass", "input_pass"]


class WeightPass:
    """One micro-batch's weight gradients, added to ``.grad`` when called. Until then it holds the
    graph above the nodes it starts from and the gradients recorded for them (:meth:`held`, which
    the memory model's profile measures: memory/memory_pass.py)."""

    __slots__ = ("_held", "_run")

    def __init__(self, run: Callable[[], None], held: Callable[[], List[Tensor]]) -> None:
        self._run, self._held = run, held

    def __call__(self) -> None:
        self._run()

    def held(self) -> List[Tensor]:
        """The gradients it starts from, kept until it runs (storages may repeat)."""
        return self._held()


def input_pass(
    edges: Sequence[GradientEdge], grads: Sequence[Tensor], wrt: Sequence[Tensor], params: Sequence[Tensor]
) -> Optional[WeightPass]:
    """Adds the gradients of ``wrt`` (leaves of the graph above ``edges``) to their ``.grad`` and
    returns the weight pass that adds the ``params``' later, or None when every gradient was made
    now: a weight whose path to the outputs never meets the input's (torch's split would miss it).

    Args:
        edges: the gradient edges of the outputs the backward starts from.
        grads: the gradients arriving for them.
        wrt: the inputs that need a gradient.
        params: the weights that need one.
    """
    if not wrt:  # nothing for the previous stage: the whole backward waits for the weight pass
        given = list(grads)
        return WeightPass(
            functools.partial(accumulate_gradients, list(edges), given, list(params)), given.copy
        )
    weights = {get_gradient_edge(p).node: p for p in params}
    reverse = reverse_graph([e.node for e in edges])
    reached = [w for w in weights if w in reverse]  # before param_groups adds keys to the defaultdict
    groups = param_groups([get_gradient_edge(x).node for x in wrt], list(weights), reverse)
    covered: Set[Node] = set().union(*(g["params"] for g in groups)) if groups else set()
    if any(w not in covered for w in reached):
        accumulate_gradients(edges, grads, [*wrt, *params])
        return None
    captured: Dict[Node, Tuple[Optional[Tensor], ...]] = {}
    handles = [
        node.register_prehook(functools.partial(_capture, captured, node))
        for group in groups
        for node in group["intermediates"]
    ]
    try:
        accumulate_keeping_graph(edges, grads, wrt)
    finally:
        for handle in handles:
            handle.remove()
    starts = [(list(g["intermediates"]), list(g["params"])) for g in groups]
    return WeightPass(
        functools.partial(_weight_pass, starts, captured, weights),
        lambda: [g for grads in captured.values() for g in grads if g is not None],
    )


def _capture(captured: Dict[Node, Any], node: Node, grads: Tuple[Optional[Tensor], ...]) -> None:
    captured[node] = grads


def _weight_pass(
    groups: List[Tuple[List[Node], List[Node]]], captured: Dict[Node, Any], weights: Dict[Node, Tensor]
) -> None:
    """The weight gradients, group by group, from the gradients the input pass recorded; where a
    group starts from several nodes, each node takes its recorded gradients instead of what the
    others pass it, so that nothing counts twice (as torch's ``stage_backward_weight``)."""
    while groups:
        nodes, params = groups.pop()
        recorded = [(n, k, g) for n in nodes for k, g in enumerate(captured.get(n, ())) if g is not None]
        edges, grads = [GradientEdge(n, k) for n, k, _ in recorded], [g for _, _, g in recorded]
        if not edges:
            continue
        handles = []
        if len(nodes) > 1:
            handles = [n.register_prehook(functools.partial(_recorded, captured.get(n))) for n in nodes]
        try:
            accumulate_gradients(edges, grads, [weights[p] for p in params])
        finally:
            for handle in handles:
                handle.remove()
        for n in nodes:
            captured.pop(n, None)


def _recorded(recorded: Any, grads: Tuple[Optional[Tensor], ...]) -> Any:
    return recorded
