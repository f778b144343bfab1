"""The bundled text (:mod:`pipeckpt.app.data.text`) as a Hugging Face model reads it: batches of
``{"input_ids", "labels"}`` (the model shifts the labels itself), tokenized by a pretrained directory's
own tokenizer when it has one, and otherwise by the app's bytes (ids 0-255; a directory without one is
said in one line).

Why not the byte pairs the app's own models read: a pretrained model knows its tokenizer's ids, and
its ``forward`` computes the loss from ``labels=``, so the training step is ``self.model(**batch).loss``
as Hugging Face's users write it.
"""

from pathlib import Path
from typing import Any, Dict, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

from pipeckpt.app.data.text import TextDataModule, Windows, check_validation, read_corpus

__all__ = ["HFTextDataModule", "has_tokenizer", "token_range"]

#: The files a saved Hugging Face tokenizer leaves in its directory (one is enough).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: Optional[str]) -> bool:
    """Whether ``directory`` holds a saved Hugging Face tokenizer."""
    return directory is not None and any((Path(directory) / f).is_file() for f in _TOKENIZER_FILES)


def _load_tokenizer(directory: str) -> Any:
    from transformers import AutoTokenizer

    # No code from the directory: a tokenizer that needs its own module is refused before this call
    # (app/models/hf_directory.py); a direct user of the data module gets transformers' refusal.
    return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)


def token_range(tokenizer: Optional[str]) -> int:
    """How many token ids the data can hold: the tokenizer's vocabulary (its added tokens included),
    or 256 for bytes."""
    if tokenizer is None or not has_tokenizer(tokenizer):
        return 256
    return len(_load_tokenizer(tokenizer))


@rank_zero_only
def _say_bytes(directory: str) -> None:
    """A model's directory without its tokenizer trains on bytes, ids its embedding learned for other
    tokens: a run that works but learns little, so it is said once, not left to be guessed."""
    print(
        f"pipeckpt: {directory} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}), so the model "
        "reads the text's bytes (ids 0-255); set data.tokenizer to a directory holding the model's "
        "tokenizer to train on its tokens",
        flush=True,
    )


class HFWindows(Windows):
    """Windows of ``seq_len`` tokens as ``{"input_ids": w, "labels": w}``."""

    def __init__(self, data: Tensor, *, seq_len: int, stride: int) -> None:
        super().__init__(data, seq_len=seq_len - 1, stride=stride)  # a window of Windows is seq_len + 1

    def __getitem__(self, index: int) -> Dict[str, Tensor]:  # type: ignore[override]
        inputs, targets = super().__getitem__(index)
        window = torch.cat([inputs, targets[-1:]])
        return {"input_ids": window, "labels": window}


class HFTextDataModule(TextDataModule):
    """:class:`TextDataModule`'s corpus and split, in Hugging Face's batches.

    Args:
        tokenizer: a local directory; its tokenizer makes the ids if it holds one (the model's
            pretrained directory), else (or None) the ids are the text's bytes.
        sample_prompt: a text whose greedy continuation the app prints after training (None: none).
        **kwargs: :class:`TextDataModule`'s.
    """

    def __init__(
        self, *, tokenizer: Optional[str] = None, sample_prompt: Optional[str] = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.tokenizer, self.sample_prompt = tokenizer, sample_prompt

    def _tokens(self) -> Tensor:
        corpus = read_corpus(self.path, pattern=self.pattern, max_bytes=self.max_bytes)
        if not has_tokenizer(self.tokenizer):
            if self.tokenizer is not None:
                _say_bytes(self.tokenizer)
            return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        assert self.tokenizer is not None
        text = corpus.decode("utf-8", errors="replace")
        ids = _load_tokenizer(self.tokenizer)(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int32)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        data = self._tokens()
        cut = len(data) - int(len(data) * self.val_fraction)
        self.train_set = HFWindows(data[:cut], seq_len=self.seq_len, stride=1)
        self.val_set = HFWindows(data[cut:], seq_len=self.seq_len, stride=self.seq_len)
        check_validation(self.val_set, self.batch_size)
