"""A look at the result: the trained model's greedy continuation of ``data.sample_prompt``, printed
by train.py after the final validation (and written to ``sample.json`` in the run directory).

Why it is generated where it is: a sample is no reason to gather a model onto one device, so it
comes from where one process already holds the whole model. That is the trained module's own model
where this process holds all of it on one device (``strategy=single``, the local engine with every
stage on the CPU, a DDP replica); otherwise (the distributed engine, or stages on several GPUs) the
directory the run exported (``pipeckpt.export.HFExport``, read in the dtype the export wrote) when
there is one, and when there is none the line names the setting that makes one. Everything here runs
in global rank 0 alone and calls no collective, so the other ranks, done with the run, never wait
on it.

The prompt is encoded by the data's tokenizer (its directory, ``datamodule.tokenizer``) without
special tokens, as the data's text is; without a tokenizer the model read bytes, so the prompt is
its UTF-8 bytes (ids 0-255), and the continuation is decoded likewise (an id over 255, which no
byte is, left out).
"""

import json
from pathlib import Path
from typing import Any, List, NamedTuple, Optional

import lightning as L
import torch
from torch import Tensor, nn

from pipeckpt.app.data.hf_text import has_tokenizer
from pipeckpt.strategy import PipelineStrategy

__all__ = ["NEW_TOKENS", "Sample", "greedy_sample", "sample_after_training"]

#: How many tokens the sample continues the prompt by (fewer where the model ends its text).
NEW_TOKENS = 20

#: How to make an export from the app: the sample's source where no process holds the whole model.
EXPORT_SETTING = "+callbacks.export='{_target_:pipeckpt.export.HFExport,dirpath:DIR}'"


class Sample(NamedTuple):
    """A prompt, its ids, the ids the model added and their text, and what generated them."""

    prompt: str
    prompt_ids: List[int]
    new_ids: List[int]
    continuation: str
    source: str


class _Codec:
    """The data's tokenizer (a directory, or an object with ``encode``/``decode``), or bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer: Any = None
        if isinstance(tokenizer, (str, Path)) and has_tokenizer(str(tokenizer)):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(
                str(tokenizer), local_files_only=True, trust_remote_code=False
            )
        elif callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None)):
            self.tokenizer = tokenizer

    def encode(self, text: str) -> List[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: List[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return str(self.tokenizer.decode(ids))


def greedy_sample(
    model: Any,
    prompt: str,
    tokenizer: Any,
    source: str,
    new_tokens: int = NEW_TOKENS,
    prompt_ids: Optional[List[int]] = None,
) -> Sample:
    """``model``'s greedy continuation of ``prompt`` by up to ``new_tokens`` tokens (``generate`` with
    ``do_sample=False``, one beam), in eval mode and without gradients; the model's mode is restored.
    ``prompt_ids``: the prompt as the data encodes it (a chat: a user turn and the generation prompt),
    else its tokens without special tokens."""
    codec = _Codec(tokenizer)
    ids = prompt_ids if prompt_ids is not None else codec.encode(prompt)
    device = next(model.parameters()).device
    inputs = torch.tensor([ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out: Tensor = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=new_tokens,
                do_sample=False,
                num_beams=1,
            )
    finally:
        model.train(was_training)
    new_ids = [int(i) for i in out[0, len(ids) :].tolist()]
    return Sample(prompt, ids, new_ids, codec.decode(new_ids), source)


def _whole_here(trainer: L.Trainer, model: nn.Module) -> bool:
    """Whether this process holds all of ``model`` on one device, as plain tensors."""
    strategy = trainer.strategy
    if isinstance(strategy, PipelineStrategy) and strategy.is_distributed:
        return False
    params = list(model.parameters())
    plain = all(type(p.data) is torch.Tensor and not p.is_meta for p in params)  # no DTensor shard
    return plain and len({p.device for p in params}) == 1


def sample_after_training(
    trainer: L.Trainer,
    module: L.LightningModule,
    datamodule: Any,
    *,
    export_dir: Optional[Path],
    output_dir: Optional[Path],
) -> Optional[str]:
    """The line to print for ``datamodule.sample_prompt`` (None: no prompt), the sample written to
    ``output_dir/sample.json`` when generated. Call on global rank 0 only."""
    prompt = getattr(datamodule, "sample_prompt", None)
    if prompt is None:
        return None
    if not prompt:
        return "sample: none (data.sample_prompt is empty: give a text to continue)"
    model = getattr(module, "model", None)
    if model is None or not callable(getattr(model, "generate", None)):
        return "sample: none (data.sample_prompt is continued by a Hugging Face model: model=hf)"
    tokenizer = getattr(datamodule, "tokenizer", None)
    as_data = getattr(datamodule, "prompt_ids", None)  # data=dataset: rendered as its rows are
    ids = as_data(prompt) if callable(as_data) else None
    if _whole_here(trainer, model):
        sample = greedy_sample(model, prompt, tokenizer, "the trained model", prompt_ids=ids)
    elif export_dir is not None and (export_dir / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        exported: Any = AutoModelForCausalLM.from_pretrained(
            export_dir,
            dtype="auto",
            local_files_only=True,
            trust_remote_code=bool(getattr(module, "trust_remote_code", False)),
        )
        exported.to(trainer.strategy.root_device)
        sample = greedy_sample(exported, prompt, tokenizer, f"the export {export_dir}", prompt_ids=ids)
    else:
        return (
            "sample: none (the model's stages lie on several processes or devices, and the sample does "
            f"not gather them onto one: export the model with {EXPORT_SETTING}, and the sample is "
            "generated from the export)"
        )
    if output_dir is not None:
        (output_dir / "sample.json").write_text(json.dumps(sample._asdict()) + "\n")
    return (
        f"sample (greedy, up to {NEW_TOKENS} new tokens, from {sample.source}): "
        f"{sample.prompt!r} -> {sample.continuation!r}"
    )
