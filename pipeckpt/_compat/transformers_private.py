"""Every reach into transformers' private names (transformers is optional: nothing here imports it).

Each entry says why no public API serves; ``tests/test_compat.py`` checks each by name and behaviour.
"""

import sys
from typing import Any, Optional

__all__ = ["output_collector"]


def output_collector() -> Optional[Any]:
    """The context variable through which transformers' ``capture_outputs`` hands a model's forward
    hooks the lists they append recorded outputs to (router logits, attentions, hidden states): its
    ``get()`` is the running forward's dict of lists (None outside one), ``set(d)`` returns a token for
    ``reset(token)``. Private: transformers has no API to record a layer call's outputs apart, which a
    pipeline stage needs to return them through its autograd Function. None when transformers' output
    capturing is not imported (no model could be recording)."""
    module = sys.modules.get("transformers.utils.output_capturing")
    return getattr(module, "_active_collector", None) if module is not None else None
