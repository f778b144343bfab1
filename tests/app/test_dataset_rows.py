"""data=dataset's rows (pipeckpt/app/data/dataset/): which tokens are labels in each format, packed
rows whose loss is the unpacked loss, and the files read from every form a user has them in, without
writing beside them. The tokenizer is the tiny pretrained Llama's (a byte-level BPE, decoding exactly)."""

import json
from pathlib import Path
from typing import Any, Dict, List

import datasets
import pytest
import torch
import transformers

from pipeckpt.app.data.dataset import DatasetDataModule
from pipeckpt.app.data.dataset.examples import IGNORE, Rendering, render_row
from pipeckpt.app.data.dataset.packing import pack, packing_refusal
from pipeckpt.app.data.dataset.templates import BUILT_IN
from pipeckpt.app.tiny_pretrained import make_tiny_pretrained, tiny_config

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what sat on the mat"},
    {"role": "assistant", "content": "the cat"},
    {"role": "user", "content": "and then"},
    {"role": "assistant", "content": "it ran off"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch) -> Path:
    """datasets' cache in this test's folder: nothing written to ~/.cache."""
    cache = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def rendering(tiny: Path, format: str, **kwargs: Any) -> Rendering:
    fields = {"text": {"text": "text"}, "prompt_response": {"prompt": "prompt", "response": "response"}}
    settings: Dict[str, Any] = {
        "tokenizer": str(tiny),
        "tokenizer_key": "",
        "format": format,
        "fields": fields.get(format, {"messages": "messages"}),
        "template": BUILT_IN["chatml"] if format == "chat" else None,
        "train_on_prompt": False,
        "seq_len": 512,
    }
    return Rendering(**{**settings, **kwargs})


def decoded(tiny: Path, ids: List[int]) -> str:
    return str(transformers.AutoTokenizer.from_pretrained(tiny).decode(ids))


def test_a_chats_labels_are_exactly_the_assistants_turns(tiny):
    row = render_row({"messages": CHAT}, rendering(tiny, "chat"))
    labelled = [i for i, label in zip(row["input_ids"], row["labels"]) if label != IGNORE]
    others = [i for i, label in zip(row["input_ids"], row["labels"]) if label == IGNORE]
    assert [label for label in row["labels"] if label != IGNORE] == labelled
    assert decoded(tiny, labelled) == "the cat<|im_end|>\nit ran off<|im_end|>\n"
    assert decoded(tiny, others) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat sat on the mat<|im_end|>\n"
        "<|im_start|>assistant\n<|im_start|>user\nand then<|im_end|>\n<|im_start|>assistant\n"
    )


def test_train_on_prompt_labels_every_token(tiny):
    row = render_row({"messages": CHAT}, rendering(tiny, "chat", train_on_prompt=True))
    assert row["labels"] == row["input_ids"]


def test_a_prompt_response_pairs_labels_are_the_response_and_the_end_token(tiny):
    row = render_row(
        {"prompt": "Q: two and two?\nA:", "response": " four"}, rendering(tiny, "prompt_response")
    )
    labelled = [label for label in row["labels"] if label != IGNORE]
    assert decoded(tiny, labelled[:-1]) == " four"
    assert labelled[-1] == transformers.AutoTokenizer.from_pretrained(tiny).eos_token_id
    assert decoded(tiny, row["input_ids"][: len(row["input_ids"]) - len(labelled)]) == "Q: two and two?\nA:"


def test_a_prompt_response_pair_with_a_template_is_a_user_and_an_assistant_turn(tiny):
    row = render_row(
        {"prompt": "two and two?", "response": "four"},
        rendering(tiny, "prompt_response", template=BUILT_IN["chatml"]),
    )
    labelled = [label for label in row["labels"] if label != IGNORE]
    assert decoded(tiny, labelled) == "four<|im_end|>\n"
    assert decoded(tiny, row["input_ids"]).startswith("<|im_start|>user\ntwo and two?<|im_end|>\n")


def test_a_text_rows_every_token_is_a_label_and_it_ends_with_the_end_token(tiny):
    row = render_row({"text": "the cat sat"}, rendering(tiny, "text"))
    assert row["labels"] == row["input_ids"]
    assert decoded(tiny, row["input_ids"][:-1]) == "the cat sat"


def test_a_row_longer_than_seq_len_is_cut_and_its_length_kept(tiny):
    row = render_row({"messages": CHAT}, rendering(tiny, "chat", seq_len=16))
    assert len(row["input_ids"]) == len(row["labels"]) == 16
    assert row["length"] == len(render_row({"messages": CHAT}, rendering(tiny, "chat"))["input_ids"])


@pytest.mark.parametrize(
    "messages,why",
    [
        (None, "it has no 'messages'"),
        ([{"role": "narrator", "content": "x"}, *CHAT], "message 1 of 'messages' has the role 'narrator'"),
        (CHAT[:2], "its 'messages' has no assistant turn"),
        ([{"role": "user"}, *CHAT], "message 1 of 'messages' has no text 'content'"),
    ],
    ids=["missing", "unknown-role", "no-assistant", "no-content"],
)
def test_a_chat_that_cannot_be_learnt_from_says_why(tiny, messages, why):
    assert render_row({"messages": messages}, rendering(tiny, "chat"))["problem"].startswith(why)


def test_pack_fills_rows_in_order_and_never_splits_an_example():
    assert pack([3, 4, 2, 0, 5, 1], seq_len=7) == [[0, 1], [2, 4], [5]]


def write_rows(path: Path, rows: List[Dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chats(count: int) -> List[Dict[str, Any]]:
    words = "the cat sat on a mat and the dog ran to it while birds sang".split()
    return [
        {
            "messages": [
                {"role": "user", "content": " ".join(words[(i + k) % 15] for k in range(2 + i % 5))},
                {"role": "assistant", "content": " ".join(words[(i * 3 + k) % 15] for k in range(1 + i % 4))},
            ]
        }
        for i in range(count)
    ]


def module(path: Path, tiny: Path, **kwargs: Any) -> DatasetDataModule:
    settings = {
        "format": "chat",
        "chat_template": "chatml",
        "seq_len": 64,
        "batch_size": 4,
        "val_fraction": 0.25,
    }
    data = DatasetDataModule(path=str(path), tokenizer=str(tiny), **{**settings, **kwargs})
    data.setup("fit")
    return data


def test_a_packed_batchs_loss_equals_the_unpacked_loss_of_the_same_examples(tiny, tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", chats(40))
    packed = module(path, tiny, packing=True, val_fraction=0.5, seq_len=128)
    unpacked = module(path, tiny, packing=False, val_fraction=0.5, seq_len=128)
    rows = [packed.train_set[i] for i in range(3)]
    examples = [e for i in range(3) for e in packed.train_set.rows[i]]
    assert len(examples) > 3  # rows of several examples
    by_example = {e: i for i, e in enumerate(r[0] for r in unpacked.train_set.rows)}
    separate = [unpacked.train_set[by_example[e]] for e in examples]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    with torch.no_grad():
        loss_packed = model(**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}).loss
        loss_separate = model(**{k: torch.stack([r[k] for r in separate]) for k in separate[0]}).loss
    assert abs(loss_packed.item() - loss_separate.item()) <= 1e-6


def test_a_packed_rows_positions_restart_at_each_example(tiny, tmp_path):
    data = module(write_rows(tmp_path / "chat.jsonl", chats(40)), tiny, packing=True, seq_len=128)
    row, examples = data.train_set[0], data.train_set.rows[0]
    lengths = [len(data.train_set.examples[e]["input_ids"]) for e in examples]
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    assert len(starts) > 1  # a row of several examples
    assert [int(row["position_ids"][s]) for s in starts] == [0] * len(starts)
    assert [int(row["labels"][s]) for s in starts[1:]] == [IGNORE] * (len(starts) - 1)


def test_packing_is_refused_for_a_model_whose_masks_ignore_position_ids():
    assert packing_refusal(tiny_config("llama")) is None
    why = packing_refusal(transformers.MambaConfig())
    assert why is not None and "masking_utils" in why


def test_parquet_csv_and_save_to_disk_read_the_same_rows(tiny, tmp_path):
    rows = [{"text": f"row {i} of the cat"} for i in range(40)]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.to_csv(str(tmp_path / "rows.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    write_rows(tmp_path / "rows.jsonl", rows)
    ids = [
        module(tmp_path / name, tiny, format="text").train_set.examples["input_ids"]
        for name in ("rows.jsonl", "rows.parquet", "rows.csv", "saved")
    ]
    assert ids[0] == ids[1] == ids[2] == ids[3]


def test_nothing_is_written_beside_the_users_data(tiny, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    datasets.Dataset.from_list(chats(40)).save_to_disk(str(folder / "saved"))
    write_rows(folder / "chat.jsonl", chats(40))
    before = sorted(str(p) for p in folder.rglob("*"))
    module(folder / "saved", tiny, packing=True)
    module(folder / "chat.jsonl", tiny)
    assert sorted(str(p) for p in folder.rglob("*")) == before


def test_a_second_setup_reads_the_tokenized_rows_from_the_cache(tiny, tmp_path, datasets_cache):
    path = write_rows(tmp_path / "chat.jsonl", chats(40))
    module(path, tiny)
    cached = sorted(datasets_cache.rglob("*.arrow"))
    again = module(path, tiny)
    assert sorted(datasets_cache.rglob("*.arrow")) == cached
    assert len(again.train_set) + len(again.val_set) == 40


def test_a_chats_sample_prompt_is_a_user_turn_and_the_generation_prompt(tiny, tmp_path):
    data = module(write_rows(tmp_path / "chat.jsonl", chats(40)), tiny)
    ids = data.prompt_ids("what sat on the mat")
    assert decoded(tiny, ids) == "<|im_start|>user\nwhat sat on the mat<|im_end|>\n<|im_start|>assistant\n"
