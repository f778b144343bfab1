"""The user's dataset as a ``LightningDataModule``: read by ``datasets``, tokenized once (cached where
``datasets`` keeps its cache, in parallel over the CPU cores, with its progress bar), checked row by
row, masked, optionally packed, and drawn by a loader that a checkpoint resumes.

The app's ``data=dataset``; a Python user passes the same arguments::

    data = DatasetDataModule(path="chat.jsonl", format="chat", tokenizer="/models/tiny",
                             chat_template="chatml", seq_len=256, batch_size=8)
"""

import hashlib
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader

from pipeckpt._errors import config_error
from pipeckpt.app.data.dataset.examples import Rendering, render_row, tokenizer_of
from pipeckpt.app.data.dataset.files import DataFiles, find_files, load_tables
from pipeckpt.app.data.dataset.packing import Rows, pack, packing_refusal
from pipeckpt.app.data.dataset.resumable import ResumableLoader
from pipeckpt.app.data.dataset.templates import chat_template

__all__ = ["FORMATS", "DatasetDataModule"]

FORMATS = ("text", "prompt_response", "chat")
TOO_LONG = ("truncate", "drop")


def _digest(directory: str) -> str:
    """A digest of the tokenizer's files: the cache's key changes with the tokenizer."""
    hasher = hashlib.sha256()
    for file in sorted(Path(directory).iterdir()):
        if file.is_file() and file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            hasher.update(file.name.encode() + file.read_bytes())
    return hasher.hexdigest()


def _column(table: Any, name: str) -> List[Any]:
    """A column as a list, read as one Arrow array (``datasets`` would decode it row by row)."""
    values: List[Any] = table.with_format("arrow")[name].to_pylist()
    return values


@rank_zero_only
def _say_too_long(setting: str, count: int, lengths: List[int], seq_len: int, too_long: str) -> None:
    """One line for the rows longer than ``seq_len``: a run that learns from cut answers, or from
    fewer rows, should not have to be guessed at."""
    done = "dropped" if too_long == "drop" else "cut to their first seq_len tokens"
    print(
        f"pipeckpt: {count} of {len(lengths)} rows of {setting} are longer than seq_len={seq_len} tokens "
        f"(the longest: {max(lengths)}), {done} (data.too_long)",
        flush=True,
    )


class DatasetDataModule(L.LightningDataModule):
    """Rows of a JSON Lines, JSON, Parquet, CSV or Arrow dataset, as a Hugging Face causal LM reads
    them (``input_ids``, ``labels``; ``position_ids`` when packed).

    Args:
        path: a data file, a directory of files of one kind, or a ``save_to_disk`` directory.
        format: ``text``, ``prompt_response`` or ``chat`` (:mod:`.examples`).
        tokenizer: the directory of the model's tokenizer (the app: the model's directory).
        seq_len: the row length; a longer example is cut or dropped, as ``too_long`` says.
        batch_size: rows a batch (per data-parallel replica).
        text_field, prompt_field, response_field, messages_field: the columns read.
        chat_template: None (the tokenizer's own), ``chatml``, or a Jinja file.
        train_on_prompt: labels on the prompt's and the user's tokens too.
        packing: pack examples into rows, with no attention across them (:mod:`.packing`).
        too_long: ``truncate`` or ``drop`` examples longer than ``seq_len``.
        val_fraction: the share of rows held out (shuffled by ``seed``), when ``val_path`` is None.
        val_path: the validation rows' own file or directory.
        seed: the split's and the training order's seed.
        num_workers: the loaders' worker processes.
        num_proc: processes tokenizing; None: for 10,000 rows or more, one a CPU core of this training
            process's share of the host, else one.
        sample_prompt: a text whose greedy continuation the app prints after training.
    """

    def __init__(
        self,
        *,
        path: str,
        format: str = "text",
        tokenizer: Optional[str] = None,
        seq_len: int = 128,
        batch_size: int = 8,
        text_field: str = "text",
        prompt_field: str = "prompt",
        response_field: str = "response",
        messages_field: str = "messages",
        chat_template: Optional[str] = None,
        train_on_prompt: bool = False,
        packing: bool = False,
        too_long: str = "truncate",
        val_fraction: float = 0.05,
        val_path: Optional[str] = None,
        seed: int = 0,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
        sample_prompt: Optional[str] = None,
    ) -> None:
        super().__init__()
        if format not in FORMATS:
            raise config_error(f"data.format={format}", f"the formats are {FORMATS}", "pick one of them")
        if too_long not in TOO_LONG:
            raise config_error(f"data.too_long={too_long}", f"the choices are {TOO_LONG}", "pick one of them")
        if tokenizer is None:
            raise config_error(
                "data.tokenizer=null",
                "a dataset's text is tokenized by the model's tokenizer",
                "set data.tokenizer to the directory holding it (model=hf sets the model's directory)",
            )
        if val_path is None and not 0.0 < val_fraction < 1.0:
            raise config_error(
                f"data.val_fraction={val_fraction}",
                "the held-out share lies strictly between 0 and 1",
                "e.g. 0.05, or give the validation rows their own file with data.val_path",
            )
        self.path, self.format, self.tokenizer, self.seq_len = path, format, tokenizer, seq_len
        self.batch_size, self.seed, self.num_workers, self.num_proc = batch_size, seed, num_workers, num_proc
        self.fields = {
            "text": {"text": text_field},
            "prompt_response": {"prompt": prompt_field, "response": response_field},
            "chat": {"messages": messages_field},
        }[format]
        self.chat_template, self.train_on_prompt, self.packing = chat_template, train_on_prompt, packing
        self.too_long, self.val_fraction, self.val_path = too_long, val_fraction, val_path
        self.sample_prompt = sample_prompt
        self.train_set: Optional[Rows] = None
        self.val_set: Optional[Rows] = None

    def _rendering(self) -> Rendering:
        assert self.tokenizer is not None
        tokenizer = tokenizer_of(self.tokenizer)
        wants_template = self.format == "chat" or (self.format == "prompt_response" and self.chat_template)
        template = chat_template(self.chat_template, tokenizer, self.tokenizer) if wants_template else None
        return Rendering(
            tokenizer=self.tokenizer,
            tokenizer_key=_digest(self.tokenizer),
            format=self.format,
            fields=self.fields,
            template=template,
            train_on_prompt=self.train_on_prompt,
            seq_len=self.seq_len,
        )

    def _examples(self, files: DataFiles, rendering: Rendering) -> Any:
        """The rows of ``files`` tokenized (cached by ``datasets``: keyed by the rows, the settings and
        the tokenizer's digest), refused at the first row that cannot be used, the too long ones cut
        or dropped."""
        import datasets

        tokenized = []
        for file, table in load_tables(files):
            missing = [f for f in self.fields.values() if f not in table.column_names]
            if missing:
                setting = {v: k for k, v in self.fields.items()}[missing[0]]
                raise config_error(
                    f"{files.setting}: the column {missing[0]!r} of {file.name}",
                    f"no row has it (the columns are {table.column_names})",
                    f"set data.{setting}_field to the column holding the {setting}",
                )
            table = table.select_columns(list(self.fields.values()))
            procs = self.num_proc or (self._cores_per_process() if len(table) >= 10_000 else 1)
            examples = table.map(
                render_row,
                fn_kwargs={"rendering": rendering},
                remove_columns=table.column_names,
                num_proc=procs if procs > 1 else None,
                desc=f"Tokenizing {file.name}",
            )
            problems = _column(examples, "problem")
            first = next((i for i, p in enumerate(problems) if p), None)
            if first is not None:
                raise config_error(
                    f"{files.setting}: row {first + 1} of {file.name}",
                    problems[first],
                    f"fix or remove the row (data.format={self.format} reads {sorted(self.fields.values())})",
                )
            tokenized.append(examples)
        examples = datasets.concatenate_datasets(tokenized) if len(tokenized) > 1 else tokenized[0]
        lengths = _column(examples, "length")
        long = [i for i, n in enumerate(lengths) if n > self.seq_len]
        if long:
            _say_too_long(files.setting, len(long), lengths, self.seq_len, self.too_long)
            if self.too_long == "drop":
                dropped = set(long)
                examples = examples.select([i for i in range(len(lengths)) if i not in dropped])
        return examples

    def _cores_per_process(self) -> int:
        """This process's share of the host's cores: every training process on a host tokenizes (into
        the one cache), and a pool of workers a process, each as large as the host, would oversubscribe
        it (the trainer's devices: its processes on this host)."""
        processes = self.trainer.num_devices if self.trainer is not None else 1
        return max(1, (os.cpu_count() or 1) // max(1, processes))

    def _rows(self, examples: Any) -> Rows:
        import pyarrow.compute  # datasets' own dependency

        lengths = pyarrow.compute.list_value_length(examples.with_format("arrow")["input_ids"]).to_pylist()
        rows = pack(lengths, self.seq_len) if self.packing else [[i] for i, n in enumerate(lengths) if n]
        tokenizer = tokenizer_of(self.tokenizer or "")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return Rows(examples, rows, seq_len=self.seq_len, pad_id=pad or 0, packed=self.packing)

    def prompt_ids(self, prompt: str) -> List[int]:
        """``prompt`` as this data's rows begin: a chat's (or a templated pair's) user turn followed by
        the template's generation prompt, else its tokens as a row's (the tokenizer's start token
        included); what the app's sample after training continues."""
        rendering = self._rendering()
        tokenizer = tokenizer_of(rendering.tokenizer)
        if rendering.template is None:
            return list(tokenizer(prompt)["input_ids"])
        chat = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(
            chat, chat_template=rendering.template, tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_packing(self) -> None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        config = getattr(module, "hf_config", None)
        refusal = packing_refusal(config) if self.packing and config is not None else None
        if refusal is not None:
            raise config_error(
                f"data.packing=true with {type(config).__name__}",
                f"packed examples must not attend to each other, and {refusal}",
                "set data.packing=false, or use a model whose masks read position_ids (docs/FINE_TUNING.md)",
            )

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        self._check_packing()
        rendering = self._rendering()
        examples = self._examples(find_files(self.path), rendering)
        if self.val_path is not None:
            val = self._examples(find_files(self.val_path, "data.val_path"), rendering)
            train = examples
        else:
            split = examples.train_test_split(test_size=self.val_fraction, seed=self.seed)
            train, val = split["train"], split["test"]
        self.train_set, self.val_set = self._rows(train), self._rows(val)
        for name, rows in (("training", self.train_set), ("validation", self.val_set)):
            if len(rows) < self.batch_size:
                where = self.val_path or self.path
                raise config_error(
                    f"data.batch_size={self.batch_size} with {where}",
                    f"the {name} split holds {len(rows)} rows, fewer than one batch",
                    "give more rows, a smaller data.batch_size, or a larger data.val_fraction",
                )

    def _replicas(self) -> Dict[str, int]:
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return {"num_replicas": kwargs.get("num_replicas", 1), "rank": kwargs.get("rank", 0)}

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() runs before the dataloaders"
        return ResumableLoader(
            self.train_set,
            batch_size=self.batch_size,
            seed=self.seed,
            num_workers=self.num_workers,
            **self._replicas(),
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "setup() runs before the dataloaders"
        return DataLoader(
            self.val_set, batch_size=self.batch_size, drop_last=True, num_workers=self.num_workers
        )
