"""The half of :class:`~pipeckpt.strategy.PipelineStrategy` that builds a module on the meta device.

Why a class of its own: Lightning asks a strategy for the context of ``configure_model`` and of
``init_module(empty_init=True)``; under a pipeline both build on meta, and each process later makes
only its own layers real (:mod:`pipeckpt.stages.materialize`, docs/DISTRIBUTED.md), which is a
question of building, not of the training loop the strategy's own class keeps to.
"""

from contextlib import contextmanager
from typing import Any, Generator, Optional

import torch
from typing_extensions import override

from pipeckpt.settings import PipeSettings
from pipeckpt.stages.materialize import (
    build_pending,
    built_on_meta,
    check_materializable,
    claim_build,
    materialize,
    on_meta,
    remember_build,
)
from pipeckpt.strategy_processes import ProcessStrategy

__all__ = ["MetaBuildStrategy"]


class MetaBuildStrategy(ProcessStrategy):
    """Builds on the meta device when Lightning asks for an empty or sharded build; ``setup``
    calls :meth:`_materialize` before anything reads the weights."""

    settings: PipeSettings
    _restore_late = False  # a module built on meta: restored after set-up (set once seen)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """A module built on meta is restored once made real: a resume's values then replace the
        initial ones (a checkpoint's too, :func:`pipeckpt.pretrained`), where loading into meta
        tensors would keep nothing."""
        module = self.lightning_module
        if module is not None and build_pending() and on_meta(module):
            self._restore_late = True  # asked again after set-up, when the build is made real
        return super().restore_checkpoint_after_setup or self._restore_late

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``init_module(empty_init=True)`` builds on the meta device; :meth:`setup` makes it real."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield
        remember_build(self.root_device)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device: each process makes only its layers real.
        A ``configure_model`` that built nothing new (its model kept from an earlier fit) is no build."""
        module = self.lightning_module
        before = {id(t) for t in module.parameters()} if module is not None else set()
        with torch.device("meta"):
            yield
        if module is None or any(t.is_meta and id(t) not in before for t in module.parameters()):
            remember_build(self.root_device)

    def _materialize(self, module: Any) -> None:
        """A module built on meta made real: here, whole, when this process holds every layer;
        otherwise the engine makes its own stages real once it knows them (docs/DISTRIBUTED.md)."""
        claim_build(module)  # where its meta build ended, if it had one
        if not built_on_meta(module):  # eager, or left on meta by a finished distributed run
            return
        check_materializable(module)  # every rank, before any work
        if self.engine.holds_every_layer:
            materialize(module, self.root_device)
        # Otherwise checkpoint='auto' profiles the meta build on fake tensors (memory/fake_weights.py).
