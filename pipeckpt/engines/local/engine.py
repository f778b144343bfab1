"""The ``local`` engine: every stage in this process, stage ``i`` on its own device.

The user's Sequential keeps its place in the module and only its call is
routed through :class:`~pipeckpt.engines.local.pipeline.LocalPipeline`, so the
user's step runs unchanged, in the caller's thread, and checkpoints keep the
module's own keys whatever the layout. Lightning's single-process defaults do
the rest; this engine overrides only building, placing and running.
"""

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from lightning.pytorch import LightningModule
from torch import nn

from pipeckpt._errors import PipeckptWarning, config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.checkpointing.compiling import compile_layers, recomputed_layers, selective_layers
from pipeckpt.engines.base import Engine
from pipeckpt.engines.local.module import ModuleRunner
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.batch_norm import convert_deferred_batch_norm
from pipeckpt.stages.gradients import window_starts, zeroed_by_lightning
from pipeckpt.stages.partition import module_name, plan
from pipeckpt.stages.stage import Stage

__all__ = ["LocalEngine"]


class LocalEngine(Engine):
    """One process drives every stage (torchgpipe's schedule; see ``local_pipeline``)."""

    name = "local"
    own_settings = {"placement": None}
    foreign_settings = (
        "these settings drive the distributed engine's processes; the local engine runs every "
        "stage in this process",
        "set engine='distributed' to use them, or drop them",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline: Optional[Union[LocalPipeline, ModuleRunner]] = None
        self.attribute = ""  # the user's name of the pipelined part, e.g. "self.layers"
        self._use_checked = False
        # strict=False: a step that bypasses the pipeline is a warning, not an error.
        self.strict: bool = self.settings.strict

    def build(
        self, module: LightningModule, sequential: nn.Sequential, devices: Sequence[torch.device]
    ) -> None:
        s = self.settings
        is_module = isinstance(sequential, ModulePipeline)
        name = module_name(module, sequential.root if isinstance(sequential, ModulePipeline) else sequential)
        if isinstance(sequential, ModulePipeline):
            names = [f"{name}.{n}" for n in sequential.names]
            if s.balance is None and s.balance_by != "params":
                raise config_error(
                    f"balance_by={s.balance_by!r} with pipeline_of({name}, ...)",
                    "profiling runs the layers as a chain, which a module with its own forward is not",
                    "use balance_by='params' or an explicit balance",
                )
        else:
            names = [f"{name}.{i}" for i in range(len(sequential))]
        sample = None if is_module else getattr(module, "example_input_array", None)
        self.plan = plan(sequential, s, devices, sample=sample, names=names)
        if s.deferred_batch_norm:
            convert_deferred_batch_norm(sequential, s.chunks)
        compile_layers(
            sequential,
            s.compile,
            selective=selective_layers(self.plan.ranges, self.plan.modes),
            recomputed=recomputed_layers(self.plan.ranges, self.plan.modes),
        )
        self.seed_layers(sequential, self.plan)  # before pipeline_of's routing takes the layers' forward
        self.attribute = f"self.{name}"
        if isinstance(sequential, ModulePipeline):
            self.pipeline = ModuleRunner(
                sequential, self.plan, chunks=s.chunks, pin_memory=s.pin_memory, name=name
            )
        else:
            self.pipeline = LocalPipeline(
                sequential,
                self.plan,
                chunks=s.chunks,
                pin_memory=s.pin_memory,
                name=self.attribute,
                names=names,
            )
            sequential.forward = self.pipeline.forward  # type: ignore[method-assign]
        self.use_layer_streams(self.pipeline.stages)
        self.pipeline.streams = self.layer_rng if self.layer_rng.enabled else None
        self.sequential = sequential
        self.module = module

    @property
    def stages(self) -> List[Stage]:
        return self.pipeline.stages if self.pipeline is not None else []

    def run(self, hook: str, module: LightningModule, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if hook == "training_step" and self.pipeline is not None:
            drop_stale_gradients(module)
        if hook != "training_step" or self._use_checked or self.pipeline is None:
            return getattr(module, hook)(*args, **kwargs)
        before = self.pipeline.calls
        out = getattr(module, hook)(*args, **kwargs)
        self._use_checked = True
        if self.pipeline.calls == before:
            self._never_called(module)
        return out

    def _never_called(self, module: LightningModule) -> None:
        what = f"{type(module).__name__}.training_step never called {self.attribute}"
        rule = (
            "configure_pipeline() returned it to be pipelined, and a step that does not call it trains "
            "without pipeline or checkpointing"
        )
        hint = (
            f"call {self.attribute}(...) in training_step, or return from configure_pipeline() the part "
            "training_step calls"
        )
        if self.strict:
            raise config_error(what, rule, hint + " (strict=False makes this a warning)")
        warnings.warn(f"{what}: {rule}. HINT: {hint}", PipeckptWarning, stacklevel=2)

    def teardown(self, module: Optional[LightningModule]) -> None:
        if isinstance(self.pipeline, ModuleRunner):
            self.pipeline.restore()
        super().teardown(module)


def drop_stale_gradients(module: LightningModule) -> None:
    """At the first batch of an accumulation window, the previous step's gradients go before
    ``training_step`` runs the pipeline's forward, not after it: Lightning zeroes them (to
    ``None``) between ``training_step`` and backward anyway, and held through the forward they
    are a whole copy of the gradients at the forward's peak (the memory model counts neither).
    Inside a window the gradients accumulate and stay; under manual optimization, or an
    ``optimizer_zero_grad`` of the module's own, nothing is known to be zeroed and nothing goes.
    ``on_before_zero_grad`` then sees no gradient there, as under the distributed engine."""
    if not module.automatic_optimization or not window_starts(module.trainer):
        return
    for p in zeroed_by_lightning(module):
        p.grad = None
