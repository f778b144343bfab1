"""The local engine for a module with its own ``forward`` (:func:`pipeckpt.pipeline_of`).

The module's ``forward`` runs unchanged once per micro-batch, and each call of a named layer is routed
to its :class:`~pipeckpt.stages.stage.Stage`, which runs it on its device under its mode. Why depth
first (micro-batch 0 through every stage, then 1, ...) and not GPipe's diagonals: the module's Python
code between layers cannot be paused; on several GPUs asynchronous kernel launches still overlap the
stages. Backward runs the last micro-batch first, as ``except_last`` assumes. The model's code after
a layer call draws from streams of the micro-batch (``layer_rng``'s :class:`AfterLayers`), as under
the distributed engine, whose processes run the passes in another order.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn

from pipeckpt.boundaries.microbatch import gather, scatter
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.boundaries.pytrees import to_device
from pipeckpt.boundaries.recorded import recording
from pipeckpt.boundaries.scalars import loss_weights, shifts_labels
from pipeckpt.boundaries.side_inputs import describe_call
from pipeckpt.checkpointing.layer_rng import NO_STREAMS, AfterLayers, LayerStreams
from pipeckpt.stages.caller import StepCasts, capture_caller_state, release_cast_cache
from pipeckpt.stages.partition import StagePlan
from pipeckpt.stages.stage import Stage, mark_shared_parameters

__all__ = ["ModuleRunner"]


class ModuleRunner:
    """Routes ``root.forward`` and each named layer's ``forward`` through the plan's stages."""

    def __init__(
        self,
        spec: ModulePipeline,
        plan: StagePlan,
        *,
        chunks: int,
        pin_memory: bool = True,
        name: str = "model",
    ) -> None:
        self.spec, self.plan, self.chunks, self.name = spec, plan, chunks, name
        layers = list(spec)
        self.stages: List[Stage] = []
        self._layer_counts: List[int] = []
        for j, ((a, b), mode, device) in enumerate(zip(plan.ranges, plan.modes, plan.devices)):
            part = nn.Sequential(*layers[a:b])
            self.stages.append(Stage(part, index=j, mode=mode, device=device, pin_memory=pin_memory))
            self.stages[-1].layer_names = tuple(f"{name}.{n}" for n in spec.names[a:b])
            self._layer_counts.append(b - a)
        mark_shared_parameters(self.stages)
        self.several_devices = len(set(plan.devices)) > 1
        self._microbatch: Optional[int] = None  # inside a pipelined call: the micro-batch running
        self._after: AfterLayers = NO_STREAMS  # the running micro-batch's streams after a layer call
        self._params: Dict[int, Tuple[nn.Parameter, ...]] = {}
        self.calls = 0
        self.streams: Optional[LayerStreams] = None  # per-layer random streams; set by the engine
        self._root_forward = spec.root.forward
        self._routed: List[nn.Module] = [spec.root]
        for j, (a, b) in enumerate(plan.ranges):
            for layer in layers[a:b]:
                layer.forward = self._route(layer, self.stages[j])
                self._routed.append(layer)
        spec.root.forward = self.forward
        self._shift = shifts_labels(spec)  # the model's loss drops each row's first label

    def _route(self, layer: nn.Module, stage: Stage) -> Callable[..., Any]:
        own = layer.forward  # the layer's bound method (or an earlier instance override)

        def routed(*args: Any, **kwargs: Any) -> Any:
            i = self._microbatch
            if i is None:  # the layer called outside a pipelined call
                return own(*args, **kwargs)
            if self.several_devices:
                args, kwargs = to_device((args, kwargs), stage.device)
            params = self._params.get(id(layer))
            if params is None:
                params = self._params[id(layer)] = tuple(p for p in layer.parameters() if p.requires_grad)
            found = recording()  # outputs the model records inside its layers (router logits)
            if found is None:
                out = stage.call_layer(own, params, i, args, kwargs)
            else:  # they leave the stage through its Function, with their gradients
                out, recorded = stage.call_layer(found.carried(own), params, i, args, kwargs)
                found.add(recorded)
            self._after.layer_returned()
            return out

        return routed

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward over the micro-batches of one mini-batch, joined back."""
        self.calls += 1
        release_cast_cache()
        streams = self.streams if self.spec.root.training else None  # None: the caller's generators
        if streams is not None:
            streams.next_call()
        call = describe_call(f"self.{self.name}", args, kwargs)
        device = self.plan.devices[-1] if self.several_devices else None
        pieces = scatter(args, kwargs, self.chunks, call=call, device=device)
        m = len(pieces)
        caller = capture_caller_state()
        recomputes = sum(n * s.recomputes_per_step(m) for n, s in zip(self._layer_counts, self.stages))
        step = StepCasts(recomputes)
        for stage in self.stages:
            stage.begin_step(m, caller, step=step)
        self._params.clear()  # which parameters train may change between steps (freezing)
        outputs = []
        try:
            for i, (a, k) in enumerate(pieces):
                self._microbatch = i
                self._after = NO_STREAMS if streams is None else streams.after_layers(i, self.plan.devices)
                with self._after:
                    outputs.append(self._root_forward(*a, **k))
        finally:
            self._microbatch, self._after = None, NO_STREAMS
        return gather(outputs, call=call, weights=lambda: loss_weights(pieces, shift=self._shift))

    def restore(self) -> None:
        """Every routed module gets its own forward back."""
        for module in self._routed:
            module.__dict__.pop("forward", None)
