"""``pipeline_of`` under the distributed engine: every stage runs the model's own ``forward``.

A model pipelined with :func:`pipeckpt.pipeline_of` is driven by its own ``forward``
(masks built on the fly, an encoder output read by every decoder layer, a tied LM head),
which no process can pause in the middle and hand to the next. So each stage, on its
own process, runs the whole ``forward`` for each micro-batch (on the same captured call
of the user's step, since every rank of a pipeline holds the same batch), and the
calls of the named layers decide what runs where:

- a layer of an earlier stage is not run: its call returns the output that stage made
  for this micro-batch, received with the stage's input, in call order;
- a layer of this stage runs through this stage's :class:`~pipeckpt.stages.stage.Stage`, under
  its checkpoint mode (one checkpoint per layer call, as under the local engine);
- the first call of a layer of a later stage ends the pass (:class:`_Handoff`): what
  crosses to the next stage is the output of every layer call so far, with the layer's
  index, as one pytree whose structure rides with torch's shape metadata
  (:mod:`.boundaries`). The next stage recomputes everything outside the layers from
  those outputs, so a value made outside the layers from an earlier stage's output (the
  encoder's final norm, a skip sum) needs no declaration.

Random numbers drawn by the model's own code outside the layers (GPT-2's embedding dropout,
the demo's positional-encoding dropout) come from the caller's generator, as under the local
engine, which runs ``forward`` once per micro-batch in micro-batch order. Here a rank may run
several passes of one micro-batch (a looped schedule puts several stages on it) and shape
inference runs one more, so each rank keeps the generator's state at the start of its first
pass of each micro-batch: a later pass of that micro-batch starts from it again and leaves the
generator as it found it, and a shape-inference pass leaves it untouched
(:class:`_Generators`). Every pass of micro-batch ``m`` therefore draws what the local engine's
pass of ``m`` draws as long as the model's own code draws before the point where each rank's
lowest stage hands off (always so for draws before the first named layer, as in GPT-2 and the
demo); a draw further on is made only by the passes that reach it, and its masks follow the
layout (``tests/engines/distributed/test_rooted_generators.py``,
``tests/engines/distributed/test_distributed_equivalence.py``).

Under a zero-bubble schedule (split backward: an input pass, then a weight pass) each stage
computes all its gradients in the input pass, as 1F1B does, and its weight pass is empty
(``whole_backward``, :class:`~.wiring.LiveStage`): a parameter outside the layers whose use
feeds a layer (the demo's target embedding, read by every decoder layer) would need that
layer's checkpoint Function to run backward a second time in the weight pass, which it
cannot (it adds its parameters' gradients in place, once). The results are exact; what is
lost is only the overlap the weight passes were to fill the bubbles with.

Why every earlier output crosses rather than only those a later stage reads: which outputs
the code outside the layers reads is not visible without tracing it, and a trace is what
this design avoids. The cost is traffic, not correctness (see the engine's limits).

Parameters outside the layers (embeddings, final norm, head) live on every rank; each
rank's gradient for them comes from the part of ``forward`` whose outputs reach its loss or
its sent tensors, and the copies are summed before the optimizer step by the tie machinery
(:mod:`.ties`), so a checkpoint holds each key once, as the unmodified model does. With data-parallel
replicas (``dp > 1``) every tensor a rank holds starts as replica 0's, and its gradients are averaged
over the replicas (:class:`.ties.Replicas`) as well as summed over the ties.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import is_view
from pipeckpt._errors import config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.engines.distributed.boundaries import announced
from pipeckpt.engines.distributed.replay import Call
from pipeckpt.engines.distributed.wiring import StageModule, _usable
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.stage import Stage, side_effect_free

__all__ = ["RootRouting", "RootStageModule", "check_module_pipeline", "outside_parameters"]

Produced = List[Tuple[int, Any]]  # (layer index, the output of its call), in call order


class _Handoff(BaseException):
    """Ends a stage's pass of the model's ``forward`` at the first call of a later stage's layer
    (a BaseException, so that the model's own ``except Exception`` does not swallow it)."""


@dataclass
class _Pass:
    stage: int
    live: bool
    microbatch: int
    received: Produced
    produced: Produced = field(default_factory=list)
    taken: int = 0  # received outputs handed out so far


class _Generators:
    """The states of the generators the model's own code draws from on this rank: the CPU one, and
    the stage device's when it is a GPU."""

    def __init__(self, device: Optional[torch.device]) -> None:
        self.device = device if device is not None and device.type == "cuda" else None

    def get(self) -> Tuple[Tensor, Optional[Tensor]]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device is not None else None
        return torch.default_generator.get_state(), cuda

    def set(self, states: Tuple[Tensor, Optional[Tensor]]) -> None:
        torch.default_generator.set_state(states[0])
        if self.device is not None and states[1] is not None:
            torch.cuda.set_rng_state(states[1], self.device)


class RootRouting:
    """Routes each named layer's calls during one stage's pass of the root's ``forward``."""

    def __init__(self, spec: ModulePipeline, ranges: Sequence[Tuple[int, int]], names: Sequence[str]) -> None:
        self.root = spec.root
        self.root_forward: Callable[..., Any] = spec.root.forward  # before any routing of the root
        self.names = list(names)
        self.stage_of = [j for j, (a, b) in enumerate(ranges) for _ in range(a, b)]
        self.last = len(ranges) - 1
        self.stages: Dict[int, Stage] = {}  # this rank's, by index (set by the engine)
        self._pass: Optional[_Pass] = None
        # micro-batch -> the generators' states at this rank's first pass of it, this step
        self._starts: Dict[int, Tuple[Tensor, Optional[Tensor]]] = {}
        self._routed: List[nn.Module] = []
        for index, layer in enumerate(spec):
            layer.forward = self._route(index, layer)
            self._routed.append(layer)

    def _route(self, index: int, layer: nn.Module) -> Callable[..., Any]:
        own = layer.forward

        def routed(*args: Any, **kwargs: Any) -> Any:
            p = self._pass
            if p is None:  # outside a pass (no other use of the layers is pipelined)
                return own(*args, **kwargs)
            owner = self.stage_of[index]
            if owner > p.stage:
                raise _Handoff()
            if owner < p.stage:
                out = self._received(p, index)
            elif p.live:
                params = tuple(q for q in layer.parameters() if q.requires_grad)
                out = self.stages[owner].call_layer(own, params, p.microbatch, args, kwargs)
            else:
                out = own(*args, **kwargs)
            p.produced.append((index, out))
            return out

        return routed

    def _received(self, p: _Pass, index: int) -> Any:
        if p.taken >= len(p.received) or p.received[p.taken][0] != index:
            sent = [self.names[i] for i, _ in p.received]
            raise config_error(
                f"the forward of {type(self.root).__name__} called {self.names[index]} on pipeline stage "
                f"{p.stage}, after stage {p.stage - 1} sent the outputs of {sent}",
                "each stage replays the model's forward and takes the earlier stages' layer outputs in the "
                "order those stages called the layers, so the layers must be called in the order "
                "pipeline_of names them, once each, the same on every micro-batch",
                "name the layers in pipeline_of(...) in the order forward calls them",
            )
        out = p.received[p.taken][1]
        p.taken += 1
        return out

    def run(self, stage: int, *, live: bool, microbatch: int, call: Call, received: Produced) -> Any:
        """Stage ``stage``'s pass of the root's forward on ``call``: the root's output on the last
        stage, elsewhere the outputs of every layer call up to the next stage's first."""
        self._pass = p = _Pass(stage, live, microbatch, list(received))
        args, kwargs = call
        generators = _Generators(self.stages[stage].device if stage in self.stages else None)
        restore: Optional[Tuple[Tensor, Optional[Tensor]]] = None
        if not live:  # shape inference: no draw of it may shift the real passes' ones
            restore = generators.get()
        else:
            if stage == min(self.stages, default=stage) and microbatch == 0:
                self._starts.clear()  # this rank's first pass of a new step
            start = self._starts.get(microbatch)
            if start is None:
                self._starts[microbatch] = generators.get()
            else:  # another stage of this rank runs this micro-batch again: the same draws
                restore = generators.get()
                generators.set(start)
        try:
            out = self.root_forward(*args, **kwargs)
        except _Handoff:
            return p.produced
        finally:
            self._pass = None
            if restore is not None:
                generators.set(restore)
        if stage != self.last:
            later = [n for n, j in zip(self.names, self.stage_of) if j > stage]
            raise config_error(
                f"the forward of {type(self.root).__name__} returned without calling {later[0]} "
                f"(the first layer of pipeline stage {stage + 1})",
                "every micro-batch's forward must call every layer named in pipeline_of, in order",
                "name in pipeline_of(...) only layers that forward calls on every input",
            )
        return out

    def restore(self) -> None:
        """Every routed layer gets its own forward back."""
        for layer in self._routed:
            layer.__dict__.pop("forward", None)


class RootStageModule(StageModule):
    """What a ``PipelineStage`` runs for stage ``j`` of a module pipeline: the root's forward,
    through :class:`RootRouting`, on the step's call of the model for this micro-batch."""

    def __init__(
        self,
        stage: Stage,
        routing: RootRouting,
        *,
        entry: Callable[[Tuple[Tensor, ...]], Call],
        calls: Callable[[int], Call],
    ) -> None:
        super().__init__(stage, entry=None)
        self.routing = routing
        self.whole_backward = True
        self._root_entry = entry
        self._calls = calls

    def forward(self, *inputs: Tensor) -> Any:
        j, live = self.stage.index, self.live
        i = self.stage.next_microbatch if live else 0  # shape inference runs on micro-batch 0
        received: Produced = []
        if j == 0:
            call = self._root_entry(inputs)
        else:
            received = self.boundaries.rebuild(j - 1, inputs)
            if not live:
                received = _usable(received)
            call = self._calls(i)
        if live:
            self.stage.take_microbatch()
            out = self.routing.run(j, live=True, microbatch=i, call=call, received=received)
        else:
            with side_effect_free(self.stage.partition):
                out = self.routing.run(j, live=False, microbatch=0, call=call, received=received)
        flat = self.boundaries.flatten(j, out, inferring=not live, names=self.names)
        flat = flat if live else announced(flat)
        if self.no_views:
            if isinstance(flat, Tensor):
                return flat.clone() if is_view(flat) else flat
            return tuple(t.clone() if is_view(t) else t for t in flat)
        return flat


def outside_parameters(spec: ModulePipeline, module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """The root's parameters that no named layer holds, under their names in ``module``."""
    inside = {id(p) for p in spec.parameters()}
    root = {id(p) for p in spec.root.parameters()}
    return [(n, p) for n, p in module.named_parameters() if id(p) in root and id(p) not in inside]


def check_module_pipeline(name: str, settings: PipeSettings) -> None:
    """Refuse what a module pipeline cannot run under the distributed engine. Every schedule runs (a
    split-backward one computes all in its input pass, module docstring), and so does ``dp > 1``."""
    what = f"pipeline_of({name}, ...) with engine='distributed'"
    if settings.balance is None and settings.balance_by != "params":
        raise config_error(
            f"balance_by={settings.balance_by!r} with {what}",
            "profiling runs the layers as a chain, which a module with its own forward is not",
            "use balance_by='params' or an explicit balance",
        )
