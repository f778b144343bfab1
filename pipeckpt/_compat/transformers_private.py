"""Every reach into Hugging Face transformers' private names: its per-module weight initialisation,
the context through which its models record outputs inside layers, and the rule ``save_pretrained``
uses to leave out tied copies.

transformers is optional: nothing here imports it at import time; a module is a Hugging Face model
only if transformers is already imported (a model of it cannot exist otherwise).
``tests/test_compat.py`` and ``tests/test_compat_transformers.py`` check each name by behaviour.
"""

import sys
from typing import Any, Callable, Dict, List, Optional

from torch import nn

__all__: List[str] = ["drop_tied_copies", "hf_init_weights", "is_hf_model", "output_collector"]


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (public class)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def hf_init_weights(model: nn.Module) -> Callable[[nn.Module], None]:
    """``model``'s initialisation of one of its modules. HF's public ``init_weights()`` and
    ``initialize_weights()`` walk the whole model at once (and skip it on the meta device); only the
    private per-module ``_init_weights(module)`` they call initialises one module, which a process
    holding some stages needs."""
    init: Callable[[nn.Module], None] = model._init_weights  # type: ignore[assignment]
    return init


def drop_tied_copies(state_dict: Dict[str, Any], model: Any) -> Dict[str, Any]:
    """``state_dict`` without the tied copies ``save_pretrained`` leaves out (GPT-2's
    ``lm_head.weight``), keeping the name ``from_pretrained`` re-ties from. Why not public: the
    rule lives in ``transformers.modeling_utils.remove_tied_weights_from_state_dict``, which
    ``save_pretrained`` calls and the documentation does not name; it accepts meta tensors."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    return remove_tied_weights_from_state_dict(dict(state_dict), model)


def output_collector() -> Optional[Any]:
    """The context variable through which transformers' ``capture_outputs`` hands a model's forward
    hooks the lists they append recorded outputs to (router logits, attentions, hidden states): its
    ``get()`` is the running forward's dict of lists (None outside one), ``set(d)`` returns a token for
    ``reset(token)``. Private: transformers has no API to record a layer call's outputs apart, which a
    pipeline stage needs to return them through its autograd Function. None when transformers' output
    capturing is not imported (no model could be recording)."""
    module = sys.modules.get("transformers.utils.output_capturing")
    return getattr(module, "_active_collector", None) if module is not None else None
