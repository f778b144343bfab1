"""A tiny pretrained directory, made here: random weights of a small Hugging Face causal LM written by
``save_pretrained`` (bf16, in several safetensors shards) and a byte-level BPE tokenizer trained on the
bundled text. Nothing is downloaded.

Why: fine-tuning (``python train.py model=hf model.path=DIR``, docs/FINE_TUNING.md) starts from a
directory as the Hub gives one; this makes one of the same layout in a second, to try the recipe and
to test it offline::

    python -m pipeckpt.app.tiny_pretrained /tmp/tiny-llama --family llama
    python train.py model=hf model.path=/tmp/tiny-llama
"""

import argparse
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from pipeckpt._errors import config_error
from pipeckpt.app.data.text import read_corpus

__all__ = ["FAMILIES", "tiny_config", "make_tiny_pretrained"]

#: The architectures offered, each small enough to train on a CPU in seconds (4 layers, width 64).
FAMILIES = ("llama", "qwen2", "gpt2")
#: The tokenizer's vocabulary (the 256 bytes, merges up to this size) and the model's.
VOCAB = 512
_TEXT_BYTES = 400_000  # of the bundled text, to train the tokenizer on (a second or two)


def tiny_config(family: str = "llama", *, vocab_size: int = VOCAB, max_positions: int = 256) -> Any:
    """The ``PretrainedConfig`` of a tiny ``family`` model (4 layers, width 64, dropout 0).

    Args:
        family: one of :data:`FAMILIES`.
        vocab_size: the model's vocabulary.
        max_positions: the longest sequence it takes.
    """
    import transformers

    common: Dict[str, Any] = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, use_cache=False)
    if family == "gpt2":
        return transformers.GPT2Config(
            n_positions=max_positions, n_embd=64, n_layer=4, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )  # fmt: skip
    kinds = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
    if family not in kinds:
        raise config_error(
            f"family={family!r}", f"the tiny families are {list(FAMILIES)}", "pick one of them"
        )
    return kinds[family](
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, attention_dropout=0.0,
        pad_token_id=0, tie_word_embeddings=False, **common,
    )  # fmt: skip


def _tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2's scheme) trained on the bundled text, as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    text = read_corpus(None, max_bytes=_TEXT_BYTES).decode("utf-8", errors="replace")
    bpe.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    special = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=special, eos_token=special, pad_token=special
    )


def make_tiny_pretrained(
    path: "str | Path",
    family: str = "llama",
    *,
    tokenizer: bool = True,
    seed: int = 0,
    max_shard_size: "int | str" = "64KB",
    max_positions: int = 256,
) -> Path:
    """Writes a tiny random ``family`` model to ``path`` as ``save_pretrained`` does, in bf16 shards of
    at most ``max_shard_size``, with (``tokenizer=True``) a byte-level BPE tokenizer of the same
    vocabulary; without one the vocabulary is the 256 bytes the app's own tokens take. Returns ``path``.
    """
    import transformers

    out = Path(path).expanduser()
    vocab = VOCAB if tokenizer else 256
    if tokenizer:
        tok = _tokenizer(vocab)
        vocab = len(tok)  # the trained merges may stop short of the size asked for
    config = tiny_config(family, vocab_size=vocab, max_positions=max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=max_shard_size)
    if tokenizer:
        tok.save_pretrained(out)
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipeckpt.app.tiny_pretrained",
        description="Write a tiny random Hugging Face model (and tokenizer) as save_pretrained does.",
    )
    parser.add_argument("path", help="the directory to write")
    parser.add_argument("--family", default="llama", choices=FAMILIES)
    parser.add_argument("--no-tokenizer", action="store_true", help="no tokenizer: a vocabulary of 256 bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="64KB")
    args = parser.parse_args(argv)
    out = make_tiny_pretrained(
        args.path,
        args.family,
        tokenizer=not args.no_tokenizer,
        seed=args.seed,
        max_shard_size=args.max_shard_size,
    )
    files: List[str] = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {', '.join(files)}")


if __name__ == "__main__":
    main()
