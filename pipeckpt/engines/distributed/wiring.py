"""Stage wiring: this process's stages, as ``torch.distributed.pipelining`` runs them.

The layers of stages held elsewhere move to the meta device: the module keeps
its structure and every parameter keeps its place in the optimizer, so model
and optimizer state keep the unpipelined module's keys and indices.

A schedule calls its stage modules in two ways: once per micro-batch, and once
before the first micro-batch of a new shape to infer the shapes it must send
and receive (on real data on the first stage, on uninitialised tensors after
it; on the last stage it also calls the loss function; in training it then runs
a backward through that forward to infer the gradients' shapes). The second call
must not count as a micro-batch of the :class:`~pipeckpt.stage.Stage` (whose
mode depends on the micro-batch index), change BatchNorm statistics, or run the
user's step. BatchNorm layers run it with ``track_running_stats`` off, so they
neither update their statistics nor keep them for that backward (restoring them
afterwards would bump their version under the inference's graph).
:class:`LiveStage` marks its module live while a micro-batch runs and remembers
the output, by which the loss function tells the two apart.
"""

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from pipeckpt._compat import BatchNormBase, DeferredBatchNorm
from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.liveness import user_code
from pipeckpt.planning import StagePlan, split
from pipeckpt.stage import Stage, side_effect_free

__all__: List[str] = []

Entry = Callable[[Tuple[Tensor, ...]], Tensor]


class StageModule(nn.Module):
    """What a ``PipelineStage`` runs: one :class:`Stage`; on the first stage also the
    ``entry`` that turns a micro-batch's tensors into the pipeline input."""

    def __init__(self, stage: Stage, entry: Optional[Entry]) -> None:
        super().__init__()
        self.stage = stage
        self._entry = entry
        self.live = False

    def forward(self, *inputs: Tensor) -> Tensor:
        x = self._entry(inputs) if self._entry is not None else inputs[0]
        if self.live:
            out: Tensor = self.stage(x)
            return out
        if not (x.is_floating_point() or x.is_complex()):
            x = torch.zeros_like(x)  # uninitialised indices would be out of range
        with _statistics_untouched(self.stage.partition):
            inferred: Tensor = self.stage.partition(x)
            return inferred


@contextmanager
def _statistics_untouched(partition: nn.Module) -> Iterator[None]:
    """Plain BatchNorm neither reads nor updates its running statistics; torchgpipe's
    DeferredBatchNorm is told it recomputes (it never passes them to the kernel in training)."""
    norms = [m for m in partition.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]
    plain = [m for m in norms if not isinstance(m, DeferredBatchNorm)]
    for m in plain:
        m.track_running_stats = False
    try:
        with side_effect_free(partition, [m for m in norms if isinstance(m, DeferredBatchNorm)]):
            yield
    finally:
        for m in plain:
            m.track_running_stats = True


class LiveStage(PipelineStage):
    """A ``PipelineStage`` that marks its module live while a real micro-batch runs."""

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
    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:  # named in pipeckpt._compat
        # Arguments pass through untouched: their list changed across torch releases.
        self.stage_module.live = True
        try:
            with user_code():  # this stage's own computation: an error here is this rank's
                output = super().forward_one_chunk(*args, **kwargs)
        finally:
            self.stage_module.live = False
        self.last_output = output
        return output

    @override
    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:  # named in pipeckpt._compat
        with user_code():  # local backward (recomputes included); sends and receives are apart
            return super().backward_one_chunk(*args, **kwargs)

    @override
    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:  # named in pipeckpt._compat
        with user_code():
            return super().backward_weight_one_chunk(*args, **kwargs)

    def ran(self, output: Any) -> bool:
        """Whether ``output`` came from a micro-batch (not from shape inference)."""
        return output is self.last_output


def shape_inference_loss(output: Tensor) -> Tensor:
    """What the loss function returns to shape inference: only its shapes are read."""
    return output.float().sum() * 0.0


def build_stages(
    sequential: nn.Sequential,
    plan: StagePlan,
    mine: Sequence[int],
    *,
    device: torch.device,
    pin_memory: bool,
    entry: Entry,
) -> List[StageModule]:
    """This process's stages ``mine``; every other stage's layers go to the meta device."""
    parts = split(sequential, plan.balance)
    for j, part in enumerate(parts):
        if j not in mine:
            part.to_empty(device="meta")  # another rank's: keep the structure, free the memory
    return [
        StageModule(
            Stage(parts[j], index=j, mode=plan.modes[j], device=device, pin_memory=pin_memory),
            entry=entry if j == 0 else None,
        )
        for j in mine
    ]


def data_parallel(
    module: StageModule, group: Optional[dist.ProcessGroup], size: int, device: torch.device
) -> nn.Module:
    """``module`` under DDP over the replicas' ``group`` (itself when there is one replica)."""
    if size == 1 or not any(p.requires_grad for p in module.parameters()):
        return module
    ddp = DistributedDataParallel(
        module,
        process_group=group,
        broadcast_buffers=False,
        device_ids=None if device.type == "cpu" else [device],
    )
    # The schedule arms DDP's reducer itself before the last micro-batch's backward.
    # Any other forward, such as the schedule's shape inference, must not arm it.
    ddp.require_backward_grad_sync = False
    return ddp


def check_all_parameters_pipelined(module: LightningModule, sequential: nn.Sequential) -> None:
    inside = {id(p) for p in sequential.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        shown = ", ".join(outside[:3]) + (", ..." if len(outside) > 3 else "")
        raise config_error(
            f"trainable parameters outside the pipelined Sequential ({shown})",
            "under the distributed engine each process holds only its stages, so a parameter "
            "outside them would have no owner",
            "move those layers into the Sequential returned by configure_pipeline(), or use engine='local'",
        )


def called_outside_a_step(*args: Any, **kwargs: Any) -> Any:
    """Stands in for the pipelined Sequential between steps."""
    raise config_error(
        "the pipelined Sequential was called outside training/validation/test/predict_step",
        "under the distributed engine each process holds only its stages, so the Sequential "
        "runs only inside a step, through the schedule",
        "call it from a step, or use engine='local'",
    )
