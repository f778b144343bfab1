"""One step of the user's unchanged hook, replayed per micro-batch through the schedule.

::

    run(hook, batch)                 every rank of a pipeline: the batch's m micro-batches
      schedule.step                  first stage: the user's step up to its Sequential call -> input
        loss_fn(output_i, i)         last stage: the user's step with the Sequential answering output_i
                                     -> loss_i / (m * accumulate_grad_batches); backward by the schedule
      broadcast from the last stage  mean loss and reduced self.log calls, replayed on every rank
    take_gradients()                 (in the strategy's backward) adds the step's gradients to .grad
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from pipeckpt._compat import tree_map
from pipeckpt._errors import PipeckptWarning
from pipeckpt.engines.distributed.liveness import user_code
from pipeckpt.engines.distributed.logs import LogRecorder, replay
from pipeckpt.engines.distributed.processes import ProcessGroups
from pipeckpt.engines.distributed.replay import Microbatches, answering, capture_input, step_loss
from pipeckpt.engines.distributed.schedules import Schedules
from pipeckpt.engines.distributed.topology import microbatches_for
from pipeckpt.engines.distributed.wiring import LiveStage, StageModule, shape_inference_loss
from pipeckpt.gradients import gradients_set_aside
from pipeckpt.stage import capture_caller_state

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

    def __post_init__(self) -> None:
        self.recorder = LogRecorder(self.hook)


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
        self._run: Optional[_Run] = None
        self._warned = False

    def __call__(self, hook: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        module, schedules = self.module, self.schedules
        assert schedules is not None and args
        train = hook == "training_step"
        batch, rest = args[0], args[1:]
        m = self._microbatches_for(Microbatches(batch, 1).size, train)
        microbatches = Microbatches(batch, m)
        schedule, stages = schedules.get(train=train, microbatches=m, signature=microbatches.signature())
        last = next((s for s in stages if s.is_last), None)
        run = _Run(hook, microbatches, rest, kwargs, last)
        if train:
            run.scale = 1.0 / (m * module.trainer.accumulate_grad_batches)
        caller = capture_caller_state()
        orders = schedules.orders(schedule, m) if train else {}
        for stage_module in self.modules:
            own = stage_module.stage
            own.begin_step(m, caller, order=orders.get(own.index))
        inputs = microbatches.tensors if any(s.is_first for s in stages) else ()
        result = None
        self._run = run
        try:
            if train:
                params = [p for sm in self.modules for p in sm.parameters() if p.requires_grad]
                with gradients_set_aside(params) as computed:
                    target = torch.arange(m) if last is not None else None
                    schedule.step(*inputs, target=target, return_outputs=False)
                self.gradients = computed
            else:
                output = schedule.step(*inputs)
                if last is not None:  # forward only: the step sees the whole batch's output
                    with user_code(), answering(module, self.sequential, output, hook, run.recorder):
                        result = getattr(module, hook)(batch, *rest, **kwargs)
        finally:
            self._run = None
            for stage in stages:
                stage.last_output = None
        payload = None
        if last is not None:
            payload = {
                "logs": run.recorder.reduced(),
                "loss": torch.stack(run.losses).mean().cpu() if train else None,
                "prediction": to_cpu(result) if hook == "predict_step" else None,
            }
        payload = self.processes.from_last_stage(payload)
        replay(module, payload["logs"], self.device)
        if train:
            return payload["loss"].to(self.device)
        return payload["prediction"] if hook == "predict_step" else result

    def take_gradients(self) -> None:
        """Adds the gradients of the last training step to ``.grad``, as a backward would."""
        for p, g in self.gradients:
            p.grad = g if p.grad is None else p.grad.add_(g)
        self.gradients = []

    def first_stage_input(self, tensors: Tuple[Tensor, ...]) -> Tensor:
        """The ``entry`` of the first stage: the user's step up to its Sequential call."""
        run = self._run
        assert run is not None
        batch = run.microbatches.rebuild(tensors)
        with user_code():
            return capture_input(self.module, self.sequential, run.hook, batch, run.rest, run.kwargs)

    def microbatch_loss(self, output: Any, target: Tensor) -> Tensor:
        """The schedule's ``loss_fn`` on the last stage: the user's step on micro-batch ``target``."""
        run = self._run
        assert run is not None
        if run.last is None or not run.last.ran(output):
            return shape_inference_loss(output)
        with user_code(), answering(self.module, self.sequential, output, run.hook, run.recorder):
            returned = self.module.training_step(run.microbatches[int(target[0])], *run.rest, **run.kwargs)
        loss = step_loss(returned, run.hook)
        run.losses.append(loss.detach().float())
        return loss * run.scale

    def _microbatches_for(self, size: int, train: bool) -> int:
        assert self.processes.topology is not None
        m = microbatches_for(size, chunks=self.chunks, topology=self.processes.topology, train=train)
        if m != self.chunks and not self._warned:
            self._warned = True
            rank_zero_warn(
                f"a batch of {size} samples cannot be cut into chunks={self.chunks} equal "
                f"micro-batches; it runs as {m} micro-batches (typically the last, smaller batch "
                "of an epoch). HINT: use a batch size that is a multiple of chunks, or drop_last=True",
                category=PipeckptWarning,
            )
        return m

    def clear(self) -> None:
        if self.schedules is not None:
            self.schedules.clear()
        self._run = None


def to_cpu(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, obj)
