"""Every reach into Hugging Face transformers' private names (its per-module weight initialisation).

transformers is optional: nothing here imports it; a module is a Hugging Face model only if
transformers is already imported (a model of it cannot exist otherwise). ``tests/test_compat.py``
checks each name by behaviour.
"""

import sys
from typing import Callable, List

from torch import nn

__all__: List[str] = ["is_hf_model", "hf_init_weights"]


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
