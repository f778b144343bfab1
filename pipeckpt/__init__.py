"""pipeckpt: pipeline parallelism and per-stage activation checkpointing for Lightning.

Importing the package registers the ``"pipe"`` strategy, so
``Trainer(strategy="pipe")`` works.
"""

from pipeckpt._errors import PipeckptCheckpointError, PipeckptConfigError, PipeckptSaveError, PipeckptWarning
from pipeckpt.boundaries.pipeline_of import pipeline_of
from pipeckpt.checkpointing.modes import ALWAYS, EXCEPT_LAST, NEVER, OFFLOAD, CheckpointMode
from pipeckpt.settings import PipeSettings
from pipeckpt.strategy import PipelineStrategy, register
from pipeckpt.weights.pretrained import pretrained

__all__ = [
    "PipelineStrategy",
    "PipeSettings",
    "pipeline_of",
    "pretrained",
    "CheckpointMode",
    "NEVER",
    "EXCEPT_LAST",
    "ALWAYS",
    "OFFLOAD",
    "PipeckptCheckpointError",
    "PipeckptConfigError",
    "PipeckptSaveError",
    "PipeckptWarning",
]
__version__ = "0.1.0"

register()
