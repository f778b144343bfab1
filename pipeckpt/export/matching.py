"""The config's model against the checkpoint, key by key and shape by shape, before a byte is written.

Why: the export writes the checkpoint's tensors under the config it is given, and a config of
another model made an export that looked whole: a vocab-256 config over a vocab-512 checkpoint wrote
512-row embeddings that ``from_pretrained`` then refused, and a 2-layer config over a 4-layer
checkpoint silently wrote 2 of the 4 layers. The model built on the meta device from the config
names every key and shape; the checkpoint's index names its own; any difference is refused here.
"""

from typing import Mapping

import torch

from pipeckpt._errors import config_error
from pipeckpt.export.source import CheckpointSource

__all__ = ["check_matches"]

_SHOWN = 3  # keys quoted in a message


def check_matches(
    source: CheckpointSource, prefix: str, expected: Mapping[str, torch.Tensor], *, config: str
) -> None:
    """Refuses a checkpoint whose tensors under ``prefix`` are not exactly ``expected``'s keys
    (the config's model's state dict, on meta) with their shapes; ``config`` names the config as
    the user gave it."""
    stored = {key[len(prefix) :]: meta for key, meta in source.shapes.items() if key.startswith(prefix)}
    missing = [key for key in expected if key not in stored]
    if len(missing) == len(expected):
        found = sorted({key.split(".", 1)[0] + "." for key in source.shapes})
        raise config_error(
            f"prefix={prefix!r}",
            f"the checkpoint {str(source.path)!r} holds no {[prefix + k for k in missing[:_SHOWN]]} "
            f"(none of the model's {len(expected)} keys; its keys start with {found[:5]})",
            "pass the attribute path of the Hugging Face model in your LightningModule with a "
            "trailing dot (self.model -> prefix='model.'), and the config of the model trained",
        )
    fix = "pass the config of the model trained (the pretrained directory it started from, or model.config)"
    if missing:
        raise config_error(
            config,
            f"its model has {len(missing)} tensors the checkpoint {str(source.path)!r} lacks under "
            f"{prefix!r}, e.g. {missing[:_SHOWN]}",
            fix,
        )
    extra = [key for key in stored if key not in expected]
    if extra:
        raise config_error(
            config,
            f"the checkpoint {str(source.path)!r} holds {len(extra)} tensors under {prefix!r} that its "
            f"model has no place for, e.g. {extra[:_SHOWN]}, so an export would leave them out",
            fix,
        )
    wrong = [key for key, meta in expected.items() if tuple(stored[key].shape) != tuple(meta.shape)]
    if wrong:
        shapes = "; ".join(
            f"{key}: {tuple(stored[key].shape)} stored, {tuple(expected[key].shape)} in the config's model"
            for key in wrong[:_SHOWN]
        )
        raise config_error(config, f"{len(wrong)} tensors of the checkpoint differ in shape ({shapes})", fix)
