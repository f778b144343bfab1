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

__all__ = ["write_adapters"]


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


def write_adapters(
    source: CheckpointSource,
    tmp: Path,
    base: nn.Module,
    adapter_config: Any,
    *,
    prefix: str,
    dtype: Optional[torch.dtype],
) -> None:
    """adapter_config.json and adapter_model.safetensors of the PEFT model at ``prefix`` (``base``:
    its base model, built on meta) into ``tmp``."""
    from peft import get_peft_model, get_peft_model_state_dict

    with torch.device("meta"):
        model = get_peft_model(base, _adapter_config(adapter_config))
    state = model.state_dict()
    key_of = {id(value): key for key, value in state.items()}
    adapters = get_peft_model_state_dict(model, state_dict=state)
    keys = [key_of[id(value)] for value in adapters.values()]
    missing = [key for key in keys if prefix + key not in source.shapes]
    if missing:
        raise config_error(
            f"prefix={prefix!r} and the adapter config",
            f"the checkpoint {str(source.path)!r} holds no {[prefix + k for k in missing[:3]]}",
            "pass the attribute path of the PEFT model in your LightningModule (self.model -> "
            "prefix='model.') and the adapter config the run trained with",
        )
    read = source.read([prefix + key for key in keys])
    trained = {key: read.pop(prefix + key).to(dtype or state[key].dtype) for key in keys}
    model.save_pretrained(str(tmp), state_dict=trained, safe_serialization=True)
