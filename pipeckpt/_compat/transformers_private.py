"""transformers' names that its documentation does not promise (imported only by pipeckpt.export,
never by ``import pipeckpt``: transformers is an optional dependency)."""

from typing import Any, Dict

__all__ = ["drop_tied_copies"]


def drop_tied_copies(state_dict: Dict[str, Any], model: Any) -> Dict[str, Any]:
    """``state_dict`` without the tied copies ``save_pretrained`` leaves out (GPT-2's
    ``lm_head.weight``), keeping the name ``from_pretrained`` re-ties from. Why not public: the
    rule lives in ``transformers.modeling_utils.remove_tied_weights_from_state_dict``, which
    ``save_pretrained`` calls and the documentation does not name; it accepts meta tensors."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    return remove_tied_weights_from_state_dict(dict(state_dict), model)
