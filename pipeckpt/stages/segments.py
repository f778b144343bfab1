"""A stage's micro-batch run in parts: segments of ``mode.every`` layers, and selective regions.

A segment is checkpointed as one (its own ``_Recompute``), so backward holds one segment's
recompute at a time; a selective region runs torch's SAC inside the Function with ``keep``, so
its backward adds gradients to ``.grad`` as every other mode does.
"""

from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence

from torch import Tensor, nn

from pipeckpt.boundaries.side_inputs import Chain
from pipeckpt.checkpointing.compiling import selective_in_graph
from pipeckpt.checkpointing.layer_rng import LayerStreams
from pipeckpt.checkpointing.selective import run_selective
from pipeckpt.stages.guards import side_effect_free
from pipeckpt.stages.recompute import Packing, Recomputable

__all__ = ["Segment", "cut", "selective"]


def selective(
    layers: nn.Module,
    forward: Callable[..., Any],
    recompute: Callable[..., Any],
    guard: Callable[[], ContextManager[Any]],
    streams: Optional[LayerStreams],
) -> Callable[..., Any]:
    """A micro-batch's run under torch's selective checkpointing, made to be run by ``_Recompute``
    with ``keep``: SAC's graph is kept inside the Function, whose backward adds the parameters'
    gradients to ``.grad`` in place as every other mode does (summed in the same order, so
    bitwise equal to ``never``, also under accumulation). SAC calls the region once in forward
    (counted by ``_run_packed``) and again to recompute: ``recompute`` counts that run, under
    the per-layer random streams (``pipeckpt.checkpointing.layer_rng``) of the micro-batch it
    recomputes (SAC restores the generators' states, not which micro-batch's streams the layers
    draw from).

    Where the ``compile`` setting compiled ``layers`` with SAC inside
    (:func:`~pipeckpt.checkpointing.compiling.selective_in_graph`), the region runs as it is: the
    compiled graph recomputes, no Python runs per op, and ``recompute`` is not called.

    Args:
        layers: the region's layers.
        forward: the region's forward run.
        recompute: the region's rerun in backward.
        guard: what keeps module state unchanged by the rerun (:func:`side_effect_free`).
        streams: the stage's per-layer random streams, when the engine set them.
    """
    if selective_in_graph(layers):
        return forward
    runs = 0
    key = streams.current() if streams is not None else None

    def region(*args: Any, **kwargs: Any) -> Any:
        nonlocal runs
        runs += 1
        if runs == 1 or streams is None:
            return (forward if runs == 1 else recompute)(*args, **kwargs)
        now = streams.current()
        streams.set_current(key)
        try:
            return recompute(*args, **kwargs)
        finally:
            streams.set_current(now)

    return lambda *args, **kwargs: run_selective(region, args, kwargs, recompute_guard=guard)


class Segment(Recomputable):
    """A run of layers of a stage, checkpointed as one (``mode.every``). A :class:`Recomputable`,
    as a stage is, so that ``_Recompute`` finds in it all it reads from a stage; it is kept in a
    plain list, not as a submodule, so the parent's parameters and state-dict keys stay as they
    were. The first segment's runs count as the parent's runs, so ``forward_calls`` keeps its
    meaning.

    Args:
        parent: the stage the segment is part of.
        layers: the positions of the segment's layers in ``all_layers``.
        all_layers: the stage's layers.
    """

    def __init__(self, parent: Recomputable, layers: range, all_layers: Sequence[nn.Module]) -> None:
        super().__init__(
            nn.Sequential(*[all_layers[k] for k in layers]),
            index=parent.index,
            mode=parent.mode,
            device=parent.device,
            pin_memory=parent.pin_memory,
        )
        self.__dict__["_parent"] = parent  # not a submodule: the parent holds this segment
        self._range = layers

    def _count(self) -> None:
        if self._range.start == 0:
            self.__dict__["_parent"].forward_calls += 1

    def _run_packed(self, packing: Packing, inputs: Sequence[Tensor]) -> Any:
        self._count()
        return super()._run_packed(packing, inputs)

    def side_of(self, side: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """This segment's share of a micro-batch's side inputs, its layers' routes set to take them."""
        if not side:
            return None
        parent: Recomputable = self.__dict__["_parent"]
        assert parent.chain is not None, "side inputs reach a stage whose engine gave it a Chain"
        steps = parent.chain.steps[self._range.start : self._range.stop]
        self.chain = Chain([layer for layer, _ in steps], [route for _, route in steps])
        mine = self.chain.keys()
        return {k: v for k, v in side.items() if k in mine} or None

    def run(self, x: Any, side: Optional[Dict[str, Any]]) -> Any:
        """One forward of the segment's layers, uncounted (``_run_packed`` counts it)."""
        return self._chain(x, **side) if side else self.partition(x)

    def run_counted(self, x: Any, side: Optional[Dict[str, Any]]) -> Any:
        """One run (forward or recompute) under selective checkpointing."""
        self._count()
        self.forward_calls += 1
        return self._chain(x, **side) if side else self.partition(x)

    def recompute_guard(self) -> ContextManager[None]:
        return side_effect_free(self.partition, self._norms())


def cut(stage: Recomputable, every: Optional[int]) -> List[Segment]:
    """``stage``'s partition cut into segments of ``every`` layers (all of it as one when None)."""
    part = stage.partition
    layers = list(part) if isinstance(part, nn.Sequential) else [part]
    n = len(layers)
    step = every or n
    return [Segment(stage, range(a, min(a + step, n)), layers) for a in range(0, n, step)]
