"""Stage wiring: this process's stages, as ``torch.distributed.pipelining`` runs them.

The layers of stages held elsewhere move to the meta device, so model and optimizer state keep the
unpipelined module's keys and indices. A schedule calls its stage modules once per micro-batch and
once per new input shape, to infer shapes; that second call must not count as a micro-batch, change
BatchNorm statistics or run the user's step. :class:`LiveStage` marks its module live while a
micro-batch runs, by which the loss function tells the two apart (docs/DESIGN.md,
engines/distributed/wiring).
"""

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from pipeckpt._compat import (
    BatchNormBase,
    DeferredBatchNorm,
    is_view,
    reducing_in_backward,
    tree_flatten,
    tree_map,
)
from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.boundaries import Boundaries, announced
from pipeckpt.engines.distributed.liveness import mark_own
from pipeckpt.stages.guards import side_effect_free
from pipeckpt.stages.partition import StagePlan, split
from pipeckpt.stages.stage import Stage, mark_shared_parameters

__all__: List[str] = []

Side = Optional[Dict[str, Any]]
# The first stage's entry: a micro-batch's batch tensors -> the pipeline input and stage 0's side inputs.
Entry = Callable[[Tuple[Tensor, ...]], Tuple[Any, Side]]
# Side inputs of stage j's micro-batch i (None: none), for the other stages.
Sides = Callable[[int, int], Side]


def _usable(x: Any) -> Any:
    """Uninitialised integer tensors (shape inference) as zeros: garbage would index out of range."""

    def fix(t: Any) -> Any:
        integer = isinstance(t, Tensor) and not (t.is_floating_point() or t.is_complex())
        return torch.zeros_like(t) if integer else t

    return fix(x) if isinstance(x, Tensor) else tree_map(fix, x)


class StageModule(nn.Module):
    """What a ``PipelineStage`` runs: one :class:`Stage` between the tensors that cross process
    boundaries (:class:`Boundaries`); on the first stage also the ``entry`` that turns a
    micro-batch's tensors into the pipeline input; elsewhere ``sides`` gives the side inputs."""

    def __init__(self, stage: Stage, entry: Optional[Entry], sides: Optional[Sides] = None) -> None:
        super().__init__()
        self.stage = stage
        self._entry = entry
        self._sides = sides
        self.live = False
        self.boundaries = Boundaries()  # the running schedule's (Schedules.get sets it)
        self.names: Tuple[str, ...] = ()
        self.no_views = False  # set for split-backward schedules, which detach outputs in place
        # Compute every gradient in the input pass of a split-backward schedule (its weight pass then
        # does nothing): for a module pipeline's stages (.rooted), whose weight pass cannot be split.
        self.whole_backward = False

    def __setattr__(self, name: str, value: Any) -> None:
        # ``live`` flips twice per micro-batch; nn.Module's __setattr__ checks every value for a
        # Parameter, Module or buffer first, which a dispatch-bound stage pays for.
        if name == "live":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, *inputs: Tensor) -> Any:
        if not self.live:
            return self._inferring(inputs)
        j = self.stage.index
        side: Side = None
        if self._entry is not None:
            x, side = self._entry(inputs)
        else:
            x = self.boundaries.rebuild(j - 1, inputs)
            if self._sides is not None:
                side = self._sides(j, self.stage.next_microbatch)
        flat = self.boundaries.flatten(j, self.stage(x, side), inferring=False, names=self.names)
        return self._unviewed(flat) if self.no_views else flat

    def _inferring(self, inputs: Tuple[Tensor, ...]) -> Any:
        """Shape inference's call: micro-batch 0's side inputs, statistics untouched, the output's
        structure recorded and its floating tensors announced as needing a gradient."""
        j = self.stage.index
        side: Side = None
        if self._entry is not None:
            x, side = self._entry(inputs)
        else:
            x = _usable(self.boundaries.rebuild(j - 1, inputs, inferring=True))
            side = self._sides(j, 0) if self._sides is not None else None
        partition = self.stage.partition
        with _statistics_untouched(partition):
            out = self.stage.chain(x, side) if side and self.stage.chain is not None else partition(x)
        flat = announced(self.boundaries.flatten(j, out, inferring=True, names=self.names))
        return self._unviewed(flat) if self.no_views else flat

    @staticmethod
    def _unviewed(flat: Any) -> Any:
        """``flat`` without views: torch's input pass detaches outputs in place, which a view refuses."""
        if isinstance(flat, Tensor):
            return flat.clone() if is_view(flat) else flat
        return tuple(t.clone() if is_view(t) else t for t in flat)


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
        boundaries: Boundaries,
    ) -> None:
        # A dw_builder makes torch run the whole backward in the input pass and call the builder's
        # runner for the weight pass (here: nothing left to do).
        dw_builder = _no_weight_pass if module.whole_backward else None
        super().__init__(submodule, index, num_stages, device, group=group, dw_builder=dw_builder)
        self.stage_module = module
        self.boundaries = boundaries
        self.last_output: Any = None
        self.outputs: List[Any] = []  # the last stage's micro-batch outputs of a forward-only step
        self.reduce_every = False  # FSDP2 reduce-scatters every micro-batch (reduce_every_microbatch)

    @override
    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:  # named in pipeckpt._compat
        # Arguments pass through untouched: their list changed across torch releases.
        live = self.stage_module.__dict__  # a plain attribute, set without nn.Module's checks
        live["live"] = True
        try:
            output = super().forward_one_chunk(*args, **kwargs)
        except BaseException as error:  # this stage's own computation: an error here is this rank's
            mark_own(error)
            raise
        finally:
            live["live"] = False
        self.last_output = output
        if self.is_last and not torch.is_grad_enabled():
            self.outputs.append(output)
        return output

    @override
    def _send_meta(self, meta: Any, dst_stage: int) -> None:  # named in pipeckpt._compat
        # The output's structure rides with torch's shape metadata to the next stage.
        if dst_stage == self.stage_index + 1:
            meta = (_STRUCTURE, meta, self.boundaries.structure(self.stage_index))
        super()._send_meta(meta, dst_stage)

    @override
    def _recv_meta(self, src_stage: int) -> Any:  # named in pipeckpt._compat
        meta = super()._recv_meta(src_stage)
        if isinstance(meta, tuple) and len(meta) == 3 and meta[0] == _STRUCTURE:
            _, meta, structure = meta
            self.boundaries.put(src_stage, structure)
        return meta

    @override
    def get_bwd_send_ops(self, bwd_chunk_id: int) -> List[dist.P2POp]:  # named in pipeckpt._compat
        # A received tensor read through a transpose (or an expand) gets a gradient with strides of
        # its own; a process group sends only contiguous tensors (Boundaries.rebuild).
        grads = self.bwd_cache.get(bwd_chunk_id) or ()
        for g in grads:  # a loop, not all(generator): this runs for every micro-batch
            if g is not None and not g.is_contiguous():
                self.bwd_cache[bwd_chunk_id] = tuple(g if g is None else g.contiguous() for g in grads)
                break
        return super().get_bwd_send_ops(bwd_chunk_id)

    @override
    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:  # named in pipeckpt._compat
        try:  # local backward (recomputes included); sends and receives are apart
            return super().backward_one_chunk(*args, **kwargs)
        except BaseException as error:
            mark_own(error)
            raise

    @override
    def backward_maybe_with_nosync(  # named in pipeckpt._compat
        self, backward_type: str, bwd_kwargs: Dict[str, Any], last_backward: bool = False
    ) -> Any:
        # torch's turns FSDP2's gradient sync and its reshard after backward off for every
        # micro-batch and reduces once, in perform_reduce_grad: until then each rank holds its
        # stage's gradients whole. Waiting saves reduce-scatters only between micro-batches; a stage
        # that runs one a step reduces as FSDP2 does alone, each unit's gradient in its backward, and
        # keeps the shards (docs/MEMORY.md, "Gradients whole until the step's end").
        # With reduce_every_microbatch it reduces in every micro-batch's backward and keeps the
        # shards, the stage's gathered units left as torch's stage keeps them.
        if backward_type == "full" and isinstance(self.submod, FSDPModule):
            if self.chunks == 1 or self.reduce_every:
                with reducing_in_backward(self.submod, reshard=self.chunks == 1):
                    return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    @override
    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:  # named in pipeckpt._compat
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        except BaseException as error:
            mark_own(error)
            raise

    def ran(self, output: Any) -> bool:
        """Whether ``output`` came from a micro-batch (not from shape inference)."""
        return output is self.last_output


_STRUCTURE = "pipeckpt-structure"


def _no_weight_pass() -> Callable[[], None]:
    """The weight pass of a stage that computed every gradient in its input pass."""
    return lambda: None


def shape_inference_loss(output: Any) -> Tensor:
    """What the loss function returns to shape inference: only its shapes are read."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    if not tensors:
        return torch.zeros((), requires_grad=True)
    return sum((t.float().sum() for t in tensors[1:]), tensors[0].float().sum()) * 0.0


def _to_meta(part: nn.Module, keep: Set[int]) -> None:
    """``part``'s parameters and buffers on the meta device, except those in ``keep`` (by id): a
    tensor that one of this process's stages shares (a tied weight) stays where it is."""
    for module in part.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in keep:
                setattr(module, name, nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and id(b) not in keep:
                setattr(module, name, torch.empty_like(b, device="meta"))


def build_stages(
    sequential: nn.Sequential,
    plan: StagePlan,
    mine: Sequence[int],
    *,
    device: torch.device,
    pin_memory: bool,
    entry: Optional[Entry] = None,
    sides: Optional[Sides] = None,
    names: Sequence[str] = (),
    keep: Set[int] = frozenset(),  # type: ignore[assignment]
    make: Optional[Callable[[Stage], StageModule]] = None,
) -> List[StageModule]:
    """This process's stages ``mine``; every other stage's layers go to the meta device (but for
    what they share with ``mine``, or ``keep`` by id). ``names``: the user's names of the layers, for
    messages. ``make``: the module that runs a stage (default :class:`StageModule`)."""
    parts = split(sequential, plan.balance)
    keep = set(keep) | {id(t) for j in mine for t in (*parts[j].parameters(), *parts[j].buffers())}
    for j, part in enumerate(parts):
        if j not in mine:
            _to_meta(part, keep)  # another rank's: keep the structure, free the memory
    modules = []
    for j in mine:
        stage = Stage(parts[j], index=j, mode=plan.modes[j], device=device, pin_memory=pin_memory)
        if make is not None:
            module = make(stage)
        else:
            module = StageModule(stage, entry=entry if j == 0 else None, sides=sides)
        a, b = plan.ranges[j]
        module.names = stage.layer_names = tuple(names[a:b])
        modules.append(module)
    mark_shared_parameters([m.stage for m in modules])
    return modules


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


def check_all_parameters_pipelined(module: LightningModule, sequential: nn.Module) -> None:
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
