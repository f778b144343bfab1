"""The ``torch.distributed.pipelining`` side of the distributed engine.

A schedule calls its stage modules in two ways: once per micro-batch, and once
before the first micro-batch of a new shape to infer the shapes it must send
and receive (on real data on the first stage, on uninitialised tensors after
it; on the last stage it also calls the loss function). The second call must
not count as a micro-batch of the :class:`~pipeckpt.stage.Stage` (whose mode
depends on the micro-batch index), change BatchNorm statistics, or run the
user's step. :class:`LiveStage` marks its module live while a micro-batch runs
and remembers the output, by which the loss function tells the two apart.

A schedule is built for one micro-batch count and one input shape (its
receive buffers have fixed sizes), so :class:`Schedules` keeps a few.
"""

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from typing_extensions import override

from pipeckpt.stage import Stage, side_effect_free

__all__: List[str] = []

_KEPT = 4  # schedules kept per train/eval


class StageModule(nn.Module):
    """What a ``PipelineStage`` runs: one :class:`Stage`; on the first stage also the
    ``entry`` that turns a micro-batch's tensors into the pipeline input."""

    def __init__(self, stage: Stage, entry: Optional[Callable[[Tuple[Tensor, ...]], Tensor]]) -> None:
        super().__init__()
        self.stage = stage
        self._entry = entry
        self.live = False

    def forward(self, *inputs: Tensor) -> Tensor:
        x = self._entry(inputs) if self._entry is not None else inputs[0]
        if self.live:
            return self.stage(x)
        if not (x.is_floating_point() or x.is_complex()):
            x = torch.zeros_like(x)  # uninitialised indices would be out of range
        with side_effect_free(self.stage.partition):
            return self.stage.partition(x)


class LiveStage(PipelineStage):
    def __init__(
        self,
        module: StageModule,
        submodule: nn.Module,
        index: int,
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
    ) -> None:
        super().__init__(submodule, index, num_stages, device, group=group)
        self.stage_module = module
        self.last_output: Any = None

    @override
    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: Tuple[Any, ...],
        kwargs: Optional[Dict[str, Any]] = None,
        save_forward_output: bool = True,
    ) -> Any:
        self.stage_module.live = True
        try:
            output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            self.stage_module.live = False
        self.last_output = output
        return output

    def ran(self, output: Any) -> bool:
        """Whether ``output`` came from a micro-batch (not from shape inference)."""
        return output is self.last_output


def shape_inference_loss(output: Tensor) -> Tensor:
    """What the loss function returns to shape inference: only its shapes are read."""
    return output.float().sum() * 0.0


class Schedules:
    """Schedules of one pipeline rank's stages, by (train, micro-batches, input shape)."""

    def __init__(
        self,
        *,
        kind: str,
        indices: Sequence[int],
        modules: Sequence[StageModule],
        trained: Sequence[nn.Module],
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        loss_fn: Callable[[Any, Tensor], Tensor],
    ) -> None:
        self.kind = kind
        self._indices, self._modules, self._trained = list(indices), list(modules), list(trained)
        self._num_stages, self._device, self._group = num_stages, device, group
        self._loss_fn = loss_fn
        self._cache: OrderedDict[Tuple[Any, ...], Tuple[Any, List[LiveStage]]] = OrderedDict()

    def get(
        self, *, train: bool, microbatches: int, signature: Tuple[Any, ...]
    ) -> Tuple[Any, List[LiveStage]]:
        key = (train, microbatches, signature)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        # Training runs the DDP-wrapped modules; forward-only runs need no gradient reduction.
        submodules = self._trained if train else self._modules
        stages = [
            LiveStage(m, s, j, self._num_stages, self._device, self._group)
            for j, m, s in zip(self._indices, self._modules, submodules)
        ]
        options: Dict[str, Any] = dict(
            n_microbatches=microbatches, scale_grads=False, loss_fn=self._loss_fn if train else None
        )
        if self.kind == "interleaved_1f1b":
            schedule: Any = ScheduleInterleaved1F1B(stages, **options)
        elif self.kind == "1f1b" and train:
            schedule = Schedule1F1B(stages[0], **options)
        else:  # GPipe, and forward-only single-stage runs (fill-drain whatever the schedule)
            schedule = ScheduleGPipe(stages[0], **options)
        self._cache[key] = (schedule, stages)
        same_kind = [k for k in self._cache if k[0] == train]
        if len(same_kind) > _KEPT:
            del self._cache[same_kind[0]]
        return schedule, stages

    def clear(self) -> None:
        self._cache.clear()
