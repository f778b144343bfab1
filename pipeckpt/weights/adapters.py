"""PEFT adapters on a model filled from a pretrained checkpoint (:func:`pipeckpt.pretrained`).

Why: the checkpoint was saved before the adapters existed. PEFT's wrappers rename the base model's
tensors (LoRA's ``q_proj.weight`` is ``q_proj.base_layer.weight``; a ``PeftModel`` puts the whole
model under ``base_model.model.``), so each name is also looked up as the unwrapped model names it;
and they add adapter tensors no pretrained checkpoint holds, which are neither missing nor left to
the base model's initialisation (Hugging Face's ``_init_weights`` would draw LoRA's B at random): they
are initialised by PEFT's own rule, LoRA's ``reset_lora_parameters`` (A by its Kaiming rule, B zero,
so the model starts as the pretrained one). Nothing here imports PEFT: a model holds PEFT layers only
if PEFT is imported already.
"""

import sys
from typing import Any, Callable, List, Optional, Set

import torch
from torch import Tensor, nn

from pipeckpt._compat import own_tensor, own_tensors, set_own_tensor
from pipeckpt._errors import config_error

__all__: List[str] = []

#: The ``init_lora_weights`` whose values PEFT draws without the base weights or data.
_DRAWN = (True, "gaussian")


def unwrapped_name(model: nn.Module, name: str) -> Optional[str]:
    """``name`` as the checkpoint of the model without PEFT's wrappers names it; None when no
    wrapper shows in it."""
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    out = name.removeprefix("base_model.model.") if isinstance(model, peft.PeftModel) else name
    out = out.replace(".base_layer.", ".")
    return out if out != name else None


def init_adapters(model: nn.Module, device: torch.device, keep: Optional[Callable[[Tensor], bool]]) -> None:
    """Every LoRA adapter tensor of ``model`` still on the meta device that ``keep`` accepts, made real
    on ``device`` and initialised by PEFT's ``reset_lora_parameters`` with the adapter's
    ``init_lora_weights`` (under ``torch.no_grad``, from the generators as they stand)."""
    if "peft" not in sys.modules:
        return
    from peft.tuners.lora import LoraLayer

    configs = getattr(model, "peft_config", None) or {}
    for where, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in [*layer.lora_A.keys(), *layer.lora_embedding_A.keys()]:
            slots = _adapter_slots(layer, adapter)
            kept = [s for s in slots if own_tensor(*s).is_meta and (keep is None or keep(own_tensor(*s)))]
            if not kept:
                continue
            config = configs.get(adapter)
            init = getattr(config, "init_lora_weights", True)
            if init not in _DRAWN:
                raise config_error(
                    f"{where} (adapter {adapter!r}, init_lora_weights={init!r}) on a model filled by "
                    "pipeckpt.pretrained",
                    f"an adapter of a model built on the meta device is initialised by PEFT's rule for "
                    f"init_lora_weights in {list(_DRAWN)} (the others need the base weights or data)",
                    "use init_lora_weights=True (the default) or 'gaussian', or load the adapter with "
                    "PeftModel.from_pretrained after an eager build",
                )
            for owner, slot, is_param in kept:
                meta = own_tensor(owner, slot, is_param)
                real = torch.empty_like(meta, device=device)
                set_own_tensor(
                    owner, slot, nn.Parameter(real, meta.requires_grad) if is_param else real, is_param
                )
            layer.reset_lora_parameters(adapter, init)


def adapter_ids(model: nn.Module) -> Set[int]:
    """The ids of ``model``'s LoRA adapter tensors: no pretrained checkpoint holds them, and none is
    missing from it (:func:`init_adapters` draws them)."""
    if "peft" not in sys.modules:
        return set()
    from peft.tuners.lora import LoraLayer

    ids: Set[int] = set()
    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            for adapter in [*layer.lora_A.keys(), *layer.lora_embedding_A.keys()]:
                ids.update(id(own_tensor(*s)) for s in _adapter_slots(layer, adapter))
    return ids


def _adapter_slots(layer: Any, adapter: str) -> List[Any]:
    """The (owner, name, is_param) of the tensors of ``layer``'s ``adapter``."""
    owners: List[nn.Module] = (
        [layer.lora_A[adapter], layer.lora_B[adapter]] if adapter in layer.lora_A else []
    )
    slots = [(o, n, p) for o in owners for n, _, p in own_tensors(o)]
    for table in (layer.lora_embedding_A, layer.lora_embedding_B):
        slots += [(table, n, p) for n, _, p in own_tensors(table) if n == adapter]
    return slots
