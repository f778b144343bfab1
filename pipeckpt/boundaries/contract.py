"""How a LightningModule names the part to pipeline: one explicit hook.

A user's module defines ``configure_pipeline()`` and returns one of its own
``nn.Sequential`` submodules, the way ``configure_optimizers()`` returns its
optimizers; or, for a model with its own ``forward``,
``pipeckpt.pipeline_of(self.model, "transformer.h")`` (see ``pipeckpt.boundaries.pipeline_of``).
Nothing is discovered by attribute name, and because the returned part stays
where the user put it, ``state_dict`` keys never change.
"""

from typing import List

from lightning.pytorch import LightningModule
from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.boundaries.pipeline_of import ModulePipeline

__all__: List[str] = []

HOOK = "configure_pipeline"


def pipelined_sequential(module: LightningModule) -> nn.Sequential:
    hook = getattr(module, HOOK, None)
    if not callable(hook):
        raise config_error(
            f"{type(module).__name__} has no {HOOK}()",
            "the 'pipe' strategy needs to know which nn.Sequential to split into stages",
            f"add `def {HOOK}(self): return self.layers` (your nn.Sequential) to the module",
        )
    seq = hook()
    if not isinstance(seq, nn.Sequential):
        raise config_error(
            f"{type(module).__name__}.{HOOK}() returned {type(seq).__name__}",
            "the pipelined part must be a torch.nn.Sequential",
            "return an nn.Sequential of your layers, e.g. nn.Sequential(*blocks), or, for a model with its "
            "own forward, pipeckpt.pipeline_of(self.model, 'transformer.h') naming its layer list",
        )
    owned = seq.root if isinstance(seq, ModulePipeline) else seq
    if not any(m is owned for m in module.modules()):
        raise config_error(
            f"{type(module).__name__}.{HOOK}() returned a Sequential that is not a submodule",
            "it must be part of the module, so its parameters are trained and checkpointed",
            "assign it as an attribute in __init__ (self.layers = nn.Sequential(...)) and return that",
        )
    if len(seq) == 0:
        raise config_error(
            f"{type(module).__name__}.{HOOK}() returned an empty Sequential",
            "a pipeline needs at least one layer",
            "return your layers",
        )
    return seq
