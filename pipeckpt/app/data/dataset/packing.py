"""Examples as rows of ``seq_len`` tokens: one example a row (padded), or several packed into one row
with no attention across them.

A packed row gives each example ``position_ids`` that restart at 0. Transformers' masks
(``transformers.masking_utils``, used by the model families written on it) read a restart as an
example boundary when the batch carries no ``attention_mask``, and let a token attend only within its
own example, under the ``sdpa``, ``eager``, ``flex_attention`` and ``flash_attention_*``
implementations. The first token of each packed example gets the label -100: a causal LM would
otherwise predict it from the previous example's last token, a term the unpacked batch never has.
So a packed batch's loss is the unpacked batch's over the same examples.

Padding goes to the right with labels -100: a causal model's earlier tokens never see it, so no
``attention_mask`` is needed and every row keeps the same shape, which a pipeline's stages expect.
"""

import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["PACKED_ATTENTION", "Rows", "pack", "packing_refusal"]

#: The attention implementations whose masks keep packed examples apart (from position_ids).
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
IGNORE = -100


def pack(lengths: Sequence[int], seq_len: int) -> List[List[int]]:
    """Example indices grouped into rows of at most ``seq_len`` tokens, in order: a row is closed when
    the next example does not fit. Empty examples are left out."""
    rows: List[List[int]] = []
    row: List[int] = []
    used = 0
    for index, length in enumerate(lengths):
        if length == 0:
            continue
        if row and used + length > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(index)
        used += length
    if row:
        rows.append(row)
    return rows


def packing_refusal(config: Any) -> Optional[str]:
    """Why a model of ``config`` cannot read packed rows (None: it can): its attention implementation
    is not one of :data:`PACKED_ATTENTION`, or its modeling code builds no mask with transformers'
    ``masking_utils``, which is what reads ``position_ids`` as example boundaries."""
    import transformers
    from transformers import masking_utils

    attention = getattr(config, "_attn_implementation", None) or "sdpa"  # transformers' default
    if attention not in PACKED_ATTENTION:
        return f"its attention implementation {attention!r} is not one of {PACKED_ATTENTION}"
    try:
        model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return f"transformers has no causal LM for its config {type(config).__name__}"
    code = sys.modules[model_class.__module__]
    if getattr(code, "create_causal_mask", None) is not masking_utils.create_causal_mask:
        return (
            f"its modeling code ({model_class.__module__}) builds no mask with transformers.masking_utils, "
            "so it cannot see where packed examples end"
        )
    return None


class Rows(Dataset):
    """Rows of ``seq_len`` tokens: each a list of example indices into ``examples`` (a
    ``datasets.Dataset`` with ``input_ids`` and ``labels``); with ``packed``, rows carry
    ``position_ids`` restarting per example.

    Args:
        examples: the tokenized examples.
        rows: the example indices of each row.
        seq_len: the row length.
        pad_id: the token id padding a row (never a label).
        packed: whether a row may hold several examples.
    """

    def __init__(
        self, examples: Any, rows: List[List[int]], *, seq_len: int, pad_id: int, packed: bool
    ) -> None:
        self.examples = examples.select_columns(["input_ids", "labels"])
        self.rows, self.seq_len, self.pad_id, self.packed = rows, seq_len, pad_id, packed

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, Tensor]:
        ids: List[int] = []
        labels: List[int] = []
        positions: List[int] = []
        picked = self.examples[self.rows[index]]
        for number, (some_ids, some_labels) in enumerate(zip(picked["input_ids"], picked["labels"])):
            ids += some_ids
            labels += [IGNORE, *some_labels[1:]] if number else some_labels
            positions += range(len(some_ids))
        pad = self.seq_len - len(ids)
        row = {
            "input_ids": torch.tensor(ids + [self.pad_id] * pad),
            "labels": torch.tensor(labels + [IGNORE] * pad),
        }
        if self.packed:  # the padding, a segment of its own
            row["position_ids"] = torch.tensor(positions + list(range(pad)))
        return row
