"""A PEFT model's adapters from a run's checkpoint, as the files ``PeftModel.from_pretrained`` reads.

Why through PEFT itself: its key naming (the adapter's name dropped, ``modules_to_save`` and biases
by the config's rule) and adapter_config.json are PEFT's to define. The PEFT model is built on the
meta device; ``get_peft_model_state_dict`` on its meta state dict names the checkpoint keys to read
(its values are the same tensors, so each maps back to its key), and ``save_pretrained`` with
``state_dict=`` those tensors writes adapter_config.json and adapter_model.safetensors. Adapters are
small: they are read at once, and the frozen base is never read.
"""

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.export.source import CheckpointSource

__all__ = ["peft_skeleton", "write_adapters"]


def _adapter_config(adapter_config: Any) -> Any:
    import peft

    if isinstance(adapter_config, peft.PeftConfig):
        return adapter_config
    path = Path(adapter_config)
    if path.is_file() and path.name == "adapter_config.json":
        path = path.parent
    if path.is_dir() and (path / "adapter_config.json").is_file():
        return peft.PeftConfig.from_pretrained(str(path))
    raise config_error(
        f"adapter_config={adapter_config!r}",
        "is a PeftConfig, or a local directory holding adapter_config.json (or that file)",
        "pass the LoraConfig the run used (self.model.peft_config['default']) or a saved adapter's directory",
    )


def peft_skeleton(base: nn.Module, adapter_config: Any) -> nn.Module:
    """The PEFT model of ``adapter_config`` over ``base``, built on the meta device: its keys and
    shapes are what the checkpoint must hold (:func:`pipeckpt.export.matching.check_matches`)."""
    from peft import get_peft_model

    with torch.device("meta"):
        return get_peft_model(base, _adapter_config(adapter_config))


def write_adapters(
    source: CheckpointSource, tmp: Path, model: nn.Module, *, prefix: str, dtype: Optional[torch.dtype]
) -> None:
    """adapter_config.json and adapter_model.safetensors of the PEFT model at ``prefix`` (``model``:
    its :func:`peft_skeleton`, checked against the checkpoint) into ``tmp``, cast to ``dtype``
    (None: as trained)."""
    from peft import get_peft_model_state_dict

    state = model.state_dict()
    key_of = {id(value): key for key, value in state.items()}
    adapters = get_peft_model_state_dict(model, state_dict=state)
    keys = [key_of[id(value)] for value in adapters.values()]
    read = source.read([prefix + key for key in keys])
    trained = {key: read.pop(prefix + key).to(dtype or state[key].dtype) for key in keys}
    model.save_pretrained(str(tmp), state_dict=trained, safe_serialization=True)  # type: ignore[operator]
