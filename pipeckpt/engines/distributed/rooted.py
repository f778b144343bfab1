"""``pipeline_of`` under the distributed engine: every stage runs the model's own ``forward``.

Why not cut ``forward`` into per-rank pieces: no process can pause Python code in the middle. So each
rank runs the whole ``forward`` per micro-batch: a layer of an earlier stage returns what that stage
sent, a layer of this stage runs under its mode, and the first call of a later stage's layer ends the
pass and sends the layer outputs so far that a later stage reads (``.handoffs``). Random draws
outside the layers (before the first layer call: the caller's generator;
after a layer call: ``layer_rng``'s :class:`AfterLayers`), zero-bubble schedules, parameters outside
the layers and data-parallel replicas: docs/DESIGN.md, engines/distributed/rooted.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from pipeckpt._compat import is_view
from pipeckpt._errors import config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.boundaries.recorded import recording
from pipeckpt.checkpointing.layer_rng import NO_STREAMS, AfterLayers
from pipeckpt.engines.distributed.boundaries import announced
from pipeckpt.engines.distributed.handoffs import Sent, standing_in, stands_in, unread_error, withheld
from pipeckpt.engines.distributed.outside_parts import OutsideParts, drop, held_parameters
from pipeckpt.engines.distributed.processes import ProcessGroups
from pipeckpt.engines.distributed.replay import Call
from pipeckpt.engines.distributed.step import PipelinedStep
from pipeckpt.engines.distributed.ties import Replicas, Ties, find_ties, held_by_stages, replicas_of
from pipeckpt.engines.distributed.topology import Topology
from pipeckpt.engines.distributed.wiring import StageModule, _usable, build_stages
from pipeckpt.settings import PipeSettings
from pipeckpt.stages.guards import side_effect_free
from pipeckpt.stages.partition import StagePlan
from pipeckpt.stages.stage import Stage
from pipeckpt.weights.pretrained import pending_reads

__all__ = ["RootRouting", "RootStageModule", "check_module_pipeline", "build_rooted"]

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
    after: AfterLayers = NO_STREAMS  # the streams of the model's code after a layer call


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
        self.standing_in: List[
            nn.Module
        ] = []  # modules outside the layers answered by zeros (.outside_parts)
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
            # Outputs the model records inside its layers (router logits) are the call's too: they
            # cross the boundaries beside its output, with their gradients (boundaries/recorded.py).
            found = recording()
            fn = own if found is None else found.carried(own)
            if owner < p.stage:
                out = self._received(p, index)
            elif p.live:
                params = tuple(q for q in layer.parameters() if q.requires_grad)
                out = self.stages[owner].call_layer(fn, params, p.microbatch, args, kwargs)
            else:
                out = fn(*args, **kwargs)
            p.produced.append((index, out))
            p.after.layer_returned()
            if found is None:
                return out
            out, recorded = out
            found.add(recorded)
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
        held = self.stages.get(stage)
        generators = _Generators(held.device if held is not None else None)
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
            if held is not None and held.streams is not None and self.root.training:
                p.after = held.streams.after_layers(microbatch, [held.device])
        try:
            with p.after:
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
        """Every routed layer gets its own forward back, and every module stood in for its own: a
        later fit (a validate, then fit) probes and builds the model afresh."""
        for layer in [*self._routed, *self.standing_in]:
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
        sent: Optional[Sent] = None,
        counts: Sequence[int] = (),
    ) -> None:
        super().__init__(stage, entry=None)
        self.routing = routing
        self.sent, self.counts = sent, counts
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
            received = self.boundaries.rebuild(j - 1, inputs, inferring=not live)
            if self.sent is not None:  # outputs withheld by the stage before: their stand-ins
                received = standing_in(received)
            if not live:
                received = _usable(received)
            call = self._calls(i)
        try:
            if live:
                self.stage.take_microbatch()
                out = self.routing.run(j, live=True, microbatch=i, call=call, received=received)
            else:
                with side_effect_free(self.stage.partition):
                    out = self.routing.run(j, live=False, microbatch=0, call=call, received=received)
            if j != self.routing.last:
                out = withheld(out, self.sent, self.counts)
        except (RuntimeError, NotImplementedError) as error:
            if self.sent is None or "meta" not in str(error) or not stands_in(received):
                raise
            raise unread_error(type(self.routing.root).__name__, j, error) from error
        flat = self.boundaries.flatten(j, out, inferring=not live, names=self.names)
        flat = flat if live else announced(flat)
        if self.no_views:
            if isinstance(flat, Tensor):
                return flat.clone() if is_view(flat) else flat
            return tuple(t.clone() if is_view(t) else t for t in flat)
        return flat


def check_module_pipeline(name: str, settings: PipeSettings) -> None:
    """Refuse what a module pipeline cannot run under the distributed engine. Every schedule runs (a
    split-backward one with its layers' weight passes, stages/weight_pass.py), and so does ``dp > 1``."""
    what = f"pipeline_of({name}, ...) with engine='distributed'"
    if settings.balance is None and settings.balance_by != "params":
        raise config_error(
            f"balance_by={settings.balance_by!r} with {what}",
            "profiling runs the layers as a chain, which a module with its own forward is not",
            "use balance_by='params' or an explicit balance",
        )


def _rooted_ties(
    module: nn.Module,
    spec: ModulePipeline,
    stage_plan: StagePlan,
    parts: OutsideParts,
    *,
    topology: Topology,
    processes: ProcessGroups,
) -> Ties:
    """A module pipeline's ties: each parameter outside the layers is one tie over the ranks of the
    stages that hold it (``parts.stages``), and those tied between layers as under a Sequential."""
    rank = processes.rank
    ties = find_ties(module, spec, stage_plan, topology, rank)
    outside = {id(p) for p in spec.root.parameters()} - {id(p) for p in spec.parameters()}
    return Ties([t for t in ties.ties if id(t.param) not in outside]) + held_by_stages(
        module, spec.root, parts.stages, topology=topology, rank=rank
    )


def build_rooted(
    module: nn.Module,
    spec: ModulePipeline,
    stage_plan: StagePlan,
    step: PipelinedStep,
    *,
    names: Sequence[str],
    processes: ProcessGroups,
    pin_memory: bool,
    parts: OutsideParts,
) -> Tuple[List[StageModule], RootRouting, Optional[Replicas], Ties]:
    """This rank's stages of a module pipeline, each running the model's forward, the routing
    between them, the replicas (``dp > 1``: averaged by :class:`.ties.Replicas`, not DDP, since a
    stage module lacks the parameters outside the layers its replay trains) and the ties."""
    topology = processes.topology
    assert topology is not None
    ties = _rooted_ties(module, spec, stage_plan, parts, topology=topology, processes=processes)
    drop(
        spec.root, parts, step.device
    )  # the outside tensors no stage of this rank reads to meta, their calls answered
    outside = held_parameters(spec.root, parts)
    routing = RootRouting(spec, stage_plan.ranges, names)
    routing.standing_in = list(parts.standing_in)
    modules = build_stages(
        spec,
        stage_plan,
        topology.stages_of(processes.rank),
        device=step.device,
        pin_memory=pin_memory,
        names=names,
        keep={id(p) for _, p in outside},
        make=lambda stage: RootStageModule(
            stage,
            routing,
            entry=step.root_call,
            calls=step.call_of,
            sent=None if parts.sent is None else parts.sent[stage.index],
            counts=parts.counts,
        ),
    )
    routing.stages = {m.stage.index: m.stage for m in modules}
    step.modules = modules
    step.outside = [p for _, p in outside]
    replicas = None
    if topology.dp > 1:  # before the ties: each replica's copies then start from replica 0's
        assert processes.dp_group is not None
        replicas = replicas_of(module, processes.dp_group, topology.dp, pending_reads(module))
    return modules, routing, replicas, ties
