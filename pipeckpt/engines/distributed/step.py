"""One step of the user's unchanged hook, replayed per micro-batch through the schedule.

::

    run(hook, batch)                 every rank of a pipeline: the batch's m micro-batches
      schedule.step                  first stage: the user's step up to its Sequential call -> input
        loss_fn(output_i, i)         last stage: the user's step with the Sequential answering output_i
                                     -> loss_i / (m * accumulate_grad_batches); backward by the schedule
      messages over the pipeline     the last stage's mean loss and reduced self.log calls, replayed
                                     on every rank; every rank's stop requests (state/preemption)
    take_gradients()                 (in the strategy's backward) adds the step's gradients to .grad
"""

from dataclasses import dataclass, field
from functools import cache
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from pipeckpt._compat import tree_map
from pipeckpt._errors import config_error
from pipeckpt.boundaries.microbatch import gather
from pipeckpt.boundaries.scalars import LossWeights, loss_weights, shifts_labels, step_weights, weigh
from pipeckpt.boundaries.side_inputs import Chain, Signatures
from pipeckpt.engines.distributed.liveness import mark_own, user_code
from pipeckpt.engines.distributed.logs import LogRecorder, replay
from pipeckpt.engines.distributed.microbatch_counts import MicrobatchCounts
from pipeckpt.engines.distributed.outcome import StepOutcome
from pipeckpt.engines.distributed.processes import ProcessGroups
from pipeckpt.engines.distributed.replay import (
    Answering,
    Call,
    Microbatches,
    answering,
    capture_call,
    step_loss,
)
from pipeckpt.engines.distributed.schedules import Schedules
from pipeckpt.engines.distributed.ties import Ties
from pipeckpt.engines.distributed.vocab_loss import (
    parallel_loss,
    plain_loss,
    split_logits_read,
    whole_outputs,
)
from pipeckpt.engines.distributed.wiring import LiveStage, Side, StageModule, shape_inference_loss
from pipeckpt.stages.caller import capture_caller_state
from pipeckpt.stages.gradients import gradients_set_aside, window_starts, zeroed_by_lightning
from pipeckpt.state.preemption import stop_requests

__all__: List[str] = []


@dataclass
class _Run:
    """One call of the user's hook in flight through the schedule."""

    hook: str
    microbatches: Microbatches
    rest: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    last: Optional[LiveStage]
    scale: float = 1.0
    recorder: LogRecorder = field(init=False)
    losses: List[Tensor] = field(default_factory=list)
    calls: Dict[int, Call] = field(default_factory=dict)  # micro-batch -> its captured call (side inputs)
    weights: Optional[LossWeights] = None  # the losses' weights by the calls' labels (None: 1/m each)
    weighed: bool = False
    answering: Optional[Answering] = None  # the last stage's, made at the first micro-batch

    def __post_init__(self) -> None:
        self.recorder = LogRecorder(self.hook)

    def scaled(self, loss: Tensor, i: int) -> Tensor:
        """Micro-batch ``i``'s ``loss`` as the schedule backpropagates it (its weight in the step,
        times ``scale``), kept detached in ``losses`` for the step's reported mean."""
        if self.weights is None:
            kept = loss.detach()
            self.losses.append(kept if kept.dtype == torch.float32 else kept.float())
            return loss * self.scale
        weight = self.weights.weights[i] * self.microbatches.count  # losses.mean() in the step
        self.losses.append(weigh(loss.detach().float(), weight))
        return weigh(loss, weight * self.scale)


class PipelinedStep:
    """Runs a LightningModule's step hooks through this process's schedules."""

    def __init__(
        self,
        module: LightningModule,
        sequential: nn.Sequential,
        modules: Sequence[StageModule],
        processes: ProcessGroups,
        *,
        chunks: int,
        device: torch.device,
    ) -> None:
        self.module, self.sequential, self.modules = module, sequential, list(modules)
        self.processes, self.chunks, self.device = processes, chunks, device
        self.schedules: Optional[Schedules] = None
        self.gradients: List[Tuple[nn.Parameter, Tensor]] = []
        self.ties: Optional[Ties] = None
        self.outside: List[nn.Parameter] = []  # a module pipeline's parameters outside its layers
        self.vocab_parallel = False  # this rank's head is split over the vocabulary (.vocab_loss)
        self.signatures: Optional[Signatures] = None
        self.ranges: List[Tuple[int, int]] = []
        self._may_take: Set[int] = set()  # stages of this rank with a layer that declares keywords
        self._chains: Dict[FrozenSet[str], bool] = {}
        self._run: Optional[_Run] = None
        self.counts = MicrobatchCounts(processes, chunks)
        self._outcome: Optional[StepOutcome] = None  # made at the first training step
        self._candidates: Tuple[nn.Parameter, ...] = ()  # this rank's parameters (see _trained)
        self._candidates_of: Tuple[int, ...] = ()

    def configure(self, signatures: Signatures, ranges: Sequence[Tuple[int, int]]) -> None:
        """The layers' signatures (side inputs) and each stage's ``(start, end)`` layers."""
        self.signatures, self.ranges = signatures, list(ranges)
        self._may_take = {
            m.stage.index
            for m in self.modules
            if any(
                lay.var_keyword or lay.names for lay in signatures.layers[slice(*self.ranges[m.stage.index])]
            )
        }

    def __call__(self, hook: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        module, schedules = self.module, self.schedules
        assert schedules is not None and args
        train = hook == "training_step"
        if train:
            self.counts.check_last_batch(module)
        batch, rest = args[0], args[1:]
        microbatches = Microbatches(batch, self.chunks)  # the usual count; cut again if another fits
        m = self.counts.of(microbatches.size, train)
        if m != self.chunks:
            microbatches = Microbatches(batch, m)
        schedule, stages = schedules.get(train=train, microbatches=m, signature=microbatches.signature())
        last, first = schedules.ends(schedule, stages)
        run = _Run(hook, microbatches, rest, kwargs, last)
        if train:
            run.scale = 1.0 / (m * module.trainer.accumulate_grad_batches)
        caller = capture_caller_state()
        orders = schedules.orders(schedule, m) if train else {}
        for stage_module in self.modules:
            own = stage_module.stage
            own.begin_step(m, caller, order=orders.get(own.index))
        inputs = microbatches.tensors if first else ()
        result = None
        self._run = run
        try:
            with parallel_loss(self.vocab_parallel):  # a loss over a split vocabulary, backward too
                if train:
                    trained, drop = self._trained(), self._zeroed_after_this_step()
                    with gradients_set_aside(trained, drop=drop) as computed:
                        target = _targets(m) if last is not None else None
                        schedule.step(*inputs, target=target, return_outputs=False)
                    self.gradients = computed
                else:
                    schedule.step(*inputs, return_outputs=False)
            if not train and last is not None:  # forward only: the step sees the whole batch's output
                outputs = [last.boundaries.rebuild_output(last.stage_index, o) for o in last.outputs]
                if self.vocab_parallel:  # the logits split over the vocabulary, gathered whole
                    outputs = [whole_outputs(o) for o in outputs]
                weights = lambda: loss_weights(self._calls(run), shift=shifts_labels(self.sequential))  # noqa: E731
                output = gather(outputs, call=f"{self._name()}(...)", weights=weights)
                with user_code(), answering(module, self.sequential, output, hook, run.recorder):
                    result = getattr(module, hook)(batch, *rest, **kwargs)
        finally:
            self._run = None
            for stage in stages:
                stage.last_output = None
                stage.outputs = []
        payload = None
        if last is not None:
            payload = {
                "logs": run.recorder.reduced(),
                "loss": torch.stack(run.losses).mean().cpu() if train else None,
                "prediction": to_cpu(result) if hook == "predict_step" else None,
            }
        payload = self._shared(payload) if train else self.processes.from_last_stage(payload)
        replay(module, payload["logs"], self.device)
        if train:
            return payload["loss"].to(self.device)
        return payload["prediction"] if hook == "predict_step" else result

    def _trained(self) -> List[nn.Parameter]:
        """The parameters this rank trains, each once (a tied weight that two stages of this rank
        share is one parameter), filtered afresh every step (``requires_grad`` may change) from
        the parameters of this rank's stages and of ``outside``, found once (as a stage's own
        ``_trainable`` does: parameters are made at build, not between steps)."""
        key = (*map(id, self.modules), id(self.outside), len(self.outside))
        if key != self._candidates_of:
            held = {id(p): p for sm in self.modules for p in sm.parameters()}
            held.update((id(p), p) for p in self.outside)
            self._candidates = tuple(held.values())
            self._candidates_of = key
        return [p for p in self._candidates if p.requires_grad]

    def _shared(self, payload: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """A training step's ``payload`` (the last stage's) on every rank of the pipeline
        (:class:`.outcome.StepOutcome`)."""
        topology, group = self.processes.topology, self.processes.pp_group
        assert topology is not None
        if topology.pp == 1 or group is None:
            assert payload is not None
            return payload
        if self._outcome is None:
            src = dist.get_global_rank(group, topology.rank_of(topology.stages - 1))
            # The stop requests ride on the outcome's collective where it reaches every rank.
            whole = dist.get_world_size(group) == dist.get_world_size()
            stops = stop_requests(self.module.trainer) if whole else []
            self._outcome = StepOutcome(group, src, self.device, stops)
        mine = payload or {}
        loss, logs = self._outcome.share(mine.get("loss"), mine.get("logs"))
        return {"logs": logs, "loss": loss, "prediction": None}

    def _zeroed_after_this_step(self) -> List[nn.Parameter]:
        """The parameters whose ``.grad`` Lightning zeroes between this ``training_step`` and its
        backward (the first batch of an accumulation window): their previous gradients are dropped
        before the schedule runs rather than held through it beside the step's own (one whole
        copy of the gradients at the schedule's peak). Inside a window they are kept, and the
        step's gradients add to them. ``on_before_zero_grad`` then sees no gradient there."""
        trainer = self.module.trainer
        return zeroed_by_lightning(self.module) if window_starts(trainer) else []

    def take_gradients(self) -> None:
        """Adds the gradients of the last training step to ``.grad``, as a backward would; a weight
        tied across ranks first gets the sum of its copies' gradients."""
        if self.ties is not None:
            self.gradients = self.ties.sum_gradients(self.gradients)
        for p, g in self.gradients:
            p.grad = g if p.grad is None else p.grad.add_(g)
        self.gradients = []

    def first_stage_input(self, tensors: Tuple[Tensor, ...]) -> Tuple[Any, Side]:
        """The ``entry`` of the first stage: the user's step up to its Sequential call, whose
        input is the pipeline's input; its keywords are the first stage's side inputs."""
        run = self._run
        assert run is not None
        batch = run.microbatches.rebuild(tensors)
        try:
            args, kwargs = capture_call(self.module, self.sequential, run.hook, batch, run.rest, run.kwargs)
            side = self._side_of(0, args, kwargs)
        except BaseException as error:  # the user's step: an error here is this rank's
            mark_own(error)
            raise
        return args[0], side

    def root_call(self, tensors: Tuple[Tensor, ...]) -> Call:
        """The first stage's entry under a module pipeline: the step's call of the model on the
        micro-batch made of ``tensors``."""
        run = self._run
        assert run is not None
        batch = run.microbatches.rebuild(tensors)
        with user_code():
            return capture_call(self.module, self.sequential, run.hook, batch, run.rest, run.kwargs)

    def call_of(self, microbatch: int) -> Call:
        """The step's call of the pipelined module on ``microbatch``, captured on this rank (which
        holds the same batch as the first stage's) once per micro-batch."""
        run = self._run
        assert run is not None
        call = run.calls.get(microbatch)
        if call is None:
            with user_code():
                call = run.calls[microbatch] = capture_call(
                    self.module, self.sequential, run.hook, run.microbatches[microbatch], run.rest, run.kwargs
                )
        return call

    def side_inputs(self, stage: int, microbatch: int) -> Side:
        """Stage ``stage``'s side inputs for ``microbatch``: this rank holds the same batch as the
        first stage's, so it captures the step's call of the Sequential itself (once per micro-batch)."""
        if stage not in self._may_take:
            return None
        call = self.call_of(microbatch)
        with user_code():
            return self._side_of(stage, *call)

    def _side_of(self, stage: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Side:
        assert self.signatures is not None
        routes = self.signatures.routes(args, kwargs)  # the call checked against the layers' signatures
        if not kwargs:
            return None
        keys = frozenset(kwargs)
        if keys not in self._chains:  # which layer of each of this rank's stages takes what
            for m in self.modules:
                a, b = self.ranges[m.stage.index]
                m.stage.chain = Chain(list(m.stage.partition.children()), routes[a:b])
            self._chains = {keys: True}
        a, b = self.ranges[stage]
        wanted = {k for r in routes[a:b] for k in r}
        return {k: v for k, v in kwargs.items() if k in wanted} or None

    def _name(self) -> str:
        return self.signatures.name if self.signatures is not None else "the pipelined Sequential"

    def microbatch_loss(self, output: Any, target: Tensor) -> Tensor:
        """The schedule's ``loss_fn`` on the last stage: the user's step on micro-batch ``target``."""
        run = self._run
        assert run is not None
        if run.last is None or not run.last.ran(output):
            return shape_inference_loss(output)
        output = run.last.boundaries.rebuild_output(run.last.stage_index, output)
        # Micro-batch i's target is ``arange(m)[i:i + 1]``, a view (torch splits the target with
        # tensor_split): its offset is i, read without a tensor operation in this per-micro-batch
        # path; a target a schedule moved off the CPU is read.
        i = int(target.storage_offset()) if target.is_cpu else int(target[0])
        within = run.answering
        if within is None:
            within = run.answering = answering(self.module, self.sequential, output, run.hook, run.recorder)
        try:
            with within.again(output):
                returned = self.module.training_step(run.microbatches[i], *run.rest, **run.kwargs)
        except BaseException as error:  # the user's step: an error here is this rank's
            named = split_logits_read(error, self.module) if self.vocab_parallel else None
            mark_own(named or error)
            if named is not None:
                raise named from error
            raise
        loss = plain_loss(step_loss(returned, run.hook))  # the model's over a split vocabulary: a DTensor
        if not run.weighed:  # a model's mean over label tokens or sum: the calls' weights, not 1/m
            rooted = not isinstance(self.sequential, nn.Sequential)  # a pipeline_of model's root
            run.weights = step_weights(self._calls(run), self.sequential) if rooted else None
            run.weighed = True
        return run.scaled(loss, i)

    def _calls(self, run: _Run) -> List[Call]:
        return [self.call_of(i) for i in range(run.microbatches.count)]

    def clear(self) -> None:
        if self.schedules is not None:
            self.schedules.clear()
        self._run = None


@cache
def _targets(m: int) -> Tensor:
    """The schedule's ``target`` on the last stage: micro-batch ``i``'s is ``i`` (made once per count)."""
    return torch.arange(m)


def to_cpu(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, obj)


def check_backward_in_step(module: LightningModule, precision: Any) -> None:
    """Refuses what a schedule that runs backward inside ``training_step`` cannot serve."""
    if not module.automatic_optimization:
        raise config_error(
            f"{type(module).__name__} uses manual optimization",
            "the distributed engine's schedule runs backward itself, inside training_step",
            "use automatic optimization, or engine='local'",
        )
    if getattr(precision, "scaler", None) is not None:
        raise config_error(
            "precision='16-mixed' (a gradient scaler)",
            "the schedule runs backward inside training_step, where the scaler cannot scale it",
            "use precision='bf16-mixed' or '32-true' with the distributed engine",
        )
