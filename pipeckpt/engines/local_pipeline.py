"""The local engine's pipeline: torchgpipe's scheduler and device worker threads.

torchgpipe's ``GPipe`` module owns its partitions (and renames their
parameters) and applies one checkpoint mode to all stages. This engine reuses
the parts of torchgpipe that are hard to get right, the clock-cycle schedule,
the per-device worker threads, the cross-device copy streams and the
micro-batch scatter/gather, but hands the pipeline :class:`~pipeckpt.stage.Stage`
modules that hold the user's own layers and checkpoint themselves, so
torchgpipe runs with its own checkpointing off.
"""

import warnings
from typing import Dict, List

from torch import Tensor, nn

from pipeckpt._compat import (
    AbstractStream,
    Pipeline,
    SkipLayout,
    current_stream,
    inspect_skip_layout,
    microbatch,
    new_stream,
)
from pipeckpt._errors import PipeckptWarning
from pipeckpt.planning import StagePlan, split
from pipeckpt.stage import Stage, capture_caller_state, stage_modules

__all__: List[str] = []


class LocalPipeline:
    """Runs the stages of a plan as a GPipe pipeline inside this process."""

    def __init__(
        self, sequential: nn.Sequential, plan: StagePlan, *, chunks: int, pin_memory: bool = True
    ) -> None:
        self.plan = plan
        self.chunks = chunks
        self.stages: List[Stage] = [
            Stage(part, index=j, mode=mode, device=device, pin_memory=pin_memory)
            for j, (part, mode, device) in enumerate(
                zip(split(sequential, plan.balance), plan.modes, plan.devices)
            )
        ]
        self.skip_layout: SkipLayout = inspect_skip_layout(stage_modules(self.stages))
        self._copy_streams: Dict[int, List[List[AbstractStream]]] = {}
        self._warned_small_batch = False

    def place(self) -> None:
        for stage in self.stages:
            stage.to(stage.device)

    def _streams(self, m: int) -> List[List[AbstractStream]]:
        if m not in self._copy_streams:
            self._copy_streams[m] = [
                [new_stream(d) if d.type == "cuda" else current_stream(d) for _ in range(m)]
                for d in self.plan.devices
            ]
        return self._copy_streams[m]

    def _scatter(self, input: Tensor) -> List[microbatch.Batch]:
        microbatch.check(input)
        first = self.plan.devices[0]
        input = input.to(first) if isinstance(input, Tensor) else tuple(x.to(first) for x in input)
        batches = microbatch.scatter(input, self.chunks)
        if len(batches) < self.chunks and not self._warned_small_batch:
            self._warned_small_batch = True
            size = (input if isinstance(input, Tensor) else input[0]).size(0)
            warnings.warn(
                f"a batch of {size} samples makes only {len(batches)} micro-batches for "
                f"chunks={self.chunks}; the pipeline runs with fewer micro-batches for such "
                "batches (typically the last, smaller batch of an epoch). HINT: use a batch "
                "size that is a multiple of chunks, or drop_last=True",
                PipeckptWarning,
                stacklevel=2,
            )
        return batches

    def forward(self, input: Tensor) -> Tensor:
        """Pipelines one mini-batch; the output is on the last stage's device."""
        batches = self._scatter(input)
        caller = capture_caller_state()
        for stage in self.stages:
            stage.begin_step(len(batches), caller)
        devices = list(self.plan.devices)
        pipeline = Pipeline(
            batches, self.stages, devices, self._streams(len(batches)), self.skip_layout, checkpoint_stop=0
        )
        pipeline.run()
        return microbatch.gather(batches)
