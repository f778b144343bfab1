"""The ``local`` engine: every stage in this process, stage ``i`` on its own device.

The user's Sequential keeps its place in the module and only its call is
routed through :class:`~pipeckpt.engines.local_pipeline.LocalPipeline`, so the
user's step runs unchanged, in the caller's thread, and checkpoints keep the
module's own keys whatever the layout. Lightning's single-process defaults do
the rest; this engine overrides only building, placing and running.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from lightning.pytorch import LightningModule
from torch import nn

from pipeckpt.batch_norm import convert_deferred_batch_norm
from pipeckpt.engines.base import Engine
from pipeckpt.engines.local_pipeline import LocalPipeline
from pipeckpt.planning import module_name, plan
from pipeckpt.stage import Stage

__all__ = ["LocalEngine"]


class LocalEngine(Engine):
    """One process drives every stage (torchgpipe's schedule; see ``local_pipeline``)."""

    name = "local"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline: Optional[LocalPipeline] = None

    def build(
        self, module: LightningModule, sequential: nn.Sequential, devices: Sequence[torch.device]
    ) -> None:
        s = self.settings
        name = module_name(module, sequential)
        self.plan = plan(
            sequential,
            devices=devices,
            stages=s.stages,
            balance=s.balance,
            balance_by=s.balance_by,
            checkpoint=s.checkpoint,
            placement=s.placement,
            sample=getattr(module, "example_input_array", None),
            chunks=s.chunks,
            prefix=f"{name}.",
        )
        if s.deferred_batch_norm:
            convert_deferred_batch_norm(sequential, s.chunks)
        self.pipeline = LocalPipeline(
            sequential,
            self.plan,
            chunks=s.chunks,
            pin_memory=s.pin_memory,
            name=f"self.{name}",
            names=[f"{name}.{i}" for i in range(len(sequential))],
        )
        sequential.forward = self.pipeline.forward  # type: ignore[method-assign]
        self.sequential = sequential
        self.module = module

    @property
    def stages(self) -> List[Stage]:
        return self.pipeline.stages if self.pipeline is not None else []

    def run(self, hook: str, module: LightningModule, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        return getattr(module, hook)(*args, **kwargs)
