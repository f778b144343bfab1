"""The local engine's pipeline: GPipe's clock-cycle schedule, run by the calling thread.

Why no worker threads (torchgpipe's ``Pipeline`` ran one per device): on one
device they buy no parallelism, and each stage and micro-batch paid two queue
hand-offs, thread wake-ups and the re-entry of the caller's autocast and
dispatch modes (thread-local) in the worker; on a CPU proxy that overhead was
several times the compute (``benchmarks/bench_dispatch.py``). Kernel launches
are asynchronous, so on several GPUs one host thread issuing the clock cycles in
order keeps them busy as long as issuing is cheaper than computing, which is
what this engine is built for. Every stage runs on its device's current stream;
PyTorch orders a cross-device copy against both devices' streams itself.

Guarantees kept from torchgpipe:

- backward order: on one device the autograd engine runs ready nodes newest
  first, so backward replays the forward schedule in reverse (each stage sees
  the last micro-batch's backward first, which ``except_last`` relies on). With
  several devices each device has its own autograd thread, so torchgpipe's
  fork/join phony edges make micro-batch ``i``'s backward of a stage wait for
  micro-batch ``i + 1``'s, as in torchgpipe;
- deferred BatchNorm: stages see their micro-batches in order, once each, and
  recomputes say so (``is_recomputing``).

Not kept: torchgpipe's ``@skippable`` skip connections (they are refused with a
clear error; return the skipped tensor as part of a tuple output instead).
"""

import warnings
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from pipeckpt._compat import fork_dependency, inspect_skip_layout, join_dependency, microbatch
from pipeckpt._errors import PipeckptWarning, config_error
from pipeckpt.planning import StagePlan, split
from pipeckpt.stage import Stage, StepCasts, capture_caller_state, release_cast_cache, stage_modules

__all__: List[str] = []

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]


def clock_cycles(m: int, n: int) -> List[List[Tuple[int, int]]]:
    """(micro-batch, stage) pairs of each clock cycle, as GPipe runs them: in cycle ``k``
    stage ``j`` runs micro-batch ``k - j``."""
    return [[(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))] for k in range(m + n - 1)]


def _first(x: TensorOrTensors) -> Tensor:
    return x if isinstance(x, Tensor) else x[0]


def _with_first(x: TensorOrTensors, first: Tensor) -> TensorOrTensors:
    return first if isinstance(x, Tensor) else (first, *x[1:])


def _to(x: TensorOrTensors, device: torch.device) -> TensorOrTensors:
    if isinstance(x, Tensor):
        return x.to(device, non_blocking=True)
    return tuple(t.to(device, non_blocking=True) for t in x)


class LocalPipeline:
    """Runs the stages of a plan as a GPipe pipeline inside this process.

    ``ordered_backward``: add torchgpipe's explicit backward-order edges between
    micro-batches; default only when the stages span several devices (one device's
    autograd thread already runs the schedule backwards).
    """

    def __init__(
        self,
        sequential: nn.Sequential,
        plan: StagePlan,
        *,
        chunks: int,
        pin_memory: bool = True,
        ordered_backward: Optional[bool] = None,
    ) -> None:
        self.plan = plan
        self.chunks = chunks
        self.stages: List[Stage] = [
            Stage(part, index=j, mode=mode, device=device, pin_memory=pin_memory)
            for j, (part, mode, device) in enumerate(
                zip(split(sequential, plan.balance), plan.modes, plan.devices)
            )
        ]
        _refuse_skip_connections(self.stages)
        self.ordered_backward = len(set(plan.devices)) > 1 if ordered_backward is None else ordered_backward
        self._warned_small_batch = False

    def place(self) -> None:
        for stage in self.stages:
            stage.to(stage.device)

    def _scatter(self, input: TensorOrTensors) -> List[TensorOrTensors]:
        microbatch.check(input)
        first = self.plan.devices[0]
        input = input.to(first) if isinstance(input, Tensor) else tuple(x.to(first) for x in input)
        if self.chunks == 1:
            return [input]
        if isinstance(input, Tensor):
            batches: List[TensorOrTensors] = list(input.chunk(self.chunks))
        else:
            batches = list(zip(*(x.chunk(self.chunks) for x in input)))
        if len(batches) < self.chunks and not self._warned_small_batch:
            self._warned_small_batch = True
            warnings.warn(
                f"a batch of {_first(input).size(0)} samples makes only {len(batches)} micro-batches for "
                f"chunks={self.chunks}; the pipeline runs with fewer micro-batches for such "
                "batches (typically the last, smaller batch of an epoch). HINT: use a batch "
                "size that is a multiple of chunks, or drop_last=True",
                PipeckptWarning,
                stacklevel=3,
            )
        return batches

    @staticmethod
    def _gather(outputs: Sequence[TensorOrTensors]) -> TensorOrTensors:
        if len(outputs) == 1:
            return outputs[0]
        if isinstance(outputs[0], Tensor):
            return torch.cat(outputs)  # type: ignore[arg-type]
        return tuple(torch.cat(parts) for parts in zip(*outputs))

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Pipelines one mini-batch; the output is on the last stage's device."""
        release_cast_cache()  # nothing cast in an earlier step may serve this one
        batches = self._scatter(input)
        m, stages = len(batches), self.stages
        caller = capture_caller_state()
        step = StepCasts(sum(s.recomputes_per_step(m) for s in stages))
        for stage in stages:
            stage.begin_step(m, caller, step=step)
        ordered = self.ordered_backward and torch.is_grad_enabled()
        for schedule in clock_cycles(m, len(stages)):
            for i, j in schedule:
                x = batches[i]
                if ordered and i > 0:
                    # batches[i - 1] holds micro-batch i-1's output of stage j - 1, whose
                    # backward must wait for micro-batch i's backward through stage j - 1.
                    prev, phony = fork_dependency(_first(batches[i - 1]))
                    batches[i - 1] = _with_first(batches[i - 1], prev)
                    x = _with_first(x, join_dependency(_first(x), phony))
                if j > 0 and stages[j].device != stages[j - 1].device:
                    x = _to(x, stages[j].device)
                batches[i] = stages[j](x)
        return self._gather(batches)


def _refuse_skip_connections(stages: List[Stage]) -> None:
    layout = inspect_skip_layout(stage_modules(stages))
    across = sorted(name for (_, name), (a, b) in layout.by_ns_name.items() if a != b)
    if across:  # a stash and pop inside one stage needs no routing
        names = across
        raise config_error(
            f"torchgpipe skip connections {names}",
            "the local engine runs stages on the calling thread and does not route @skippable stash/pop",
            "return the skipped tensor with the layer's output as a tuple, and take it as a tuple in "
            "the layer that uses it",
        )
