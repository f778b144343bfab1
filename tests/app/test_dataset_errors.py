"""data=dataset refuses bad data before training, in one line naming the file, the row or line, and
the setting (pipeckpt/app/data/dataset/files.py, module.py), and says in one line how many rows were
too long and what became of them."""

from pathlib import Path
from typing import Any, Dict, List

import datasets
import pytest
from test_dataset_rows import chats, write_rows
from test_train_e2e import train

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.data.dataset import DatasetDataModule
from pipeckpt.app.tiny_pretrained import make_tiny_pretrained


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama")


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


def refusal(path: Path, tiny: Path, **kwargs: Any) -> str:
    settings: Dict[str, Any] = {"format": "chat", "chat_template": "chatml", "seq_len": 64, "batch_size": 2}
    data = DatasetDataModule(path=str(path), tokenizer=str(tiny), **{**settings, **kwargs})
    with pytest.raises(PipeckptConfigError) as error:
        data.setup("fit")
    message = str(error.value)
    assert message.count(". HINT: ") == 1, message
    return message


def without(rows: List[Dict[str, Any]], number: int, field: str) -> List[Dict[str, Any]]:
    """``rows`` with row ``number`` (1-based) lacking ``field``."""
    rows[number - 1] = {"other": 1}
    return rows


def test_a_row_without_its_field_is_named_by_row_and_field(tiny, tmp_path):
    message = refusal(write_rows(tmp_path / "chat.jsonl", without(chats(50), 38, "messages")), tiny)
    assert message.startswith(
        f"data.path={tmp_path / 'chat.jsonl'}: row 38 of chat.jsonl: it has no 'messages'"
    )


def test_a_row_in_the_second_file_of_a_directory_is_named_in_that_file(tiny, tmp_path):
    write_rows(tmp_path / "a.jsonl", chats(20))
    write_rows(tmp_path / "b.jsonl", without(chats(20), 7, "messages"))
    assert "row 7 of b.jsonl: it has no 'messages'" in refusal(tmp_path, tiny)


def test_a_column_no_row_has_names_the_field_setting(tiny, tmp_path):
    message = refusal(write_rows(tmp_path / "chat.jsonl", [{"turns": []}] * 10), tiny)
    assert "the column 'messages' of chat.jsonl" in message and "data.messages_field" in message


def test_an_empty_file_is_refused(tiny, tmp_path):
    (tmp_path / "chat.jsonl").write_text("\n")
    assert "chat.jsonl: the file is empty" in refusal(tmp_path / "chat.jsonl", tiny)


def test_a_line_that_is_not_utf8_is_named_by_line(tiny, tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", chats(10))
    path.write_bytes(path.read_bytes() + b'{"messages": "\xff"}\n')
    assert "line 11 of chat.jsonl: the line is not UTF-8 (byte 0xff)" in refusal(path, tiny)


def test_a_line_that_is_not_json_is_named_by_line(tiny, tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", chats(10))
    path.write_text(path.read_text() + '{"messages": oops}\n')
    assert "line 11 of chat.jsonl: it is not JSON" in refusal(path, tiny)


def test_a_message_with_an_unknown_role_is_named_by_row(tiny, tmp_path):
    rows = chats(10)
    rows[4]["messages"][0]["role"] = "narrator"
    assert "row 5 of chat.jsonl: message 1 of 'messages' has the role 'narrator'" in refusal(
        write_rows(tmp_path / "chat.jsonl", rows), tiny
    )


def test_a_chat_without_an_assistant_turn_is_named_by_row(tiny, tmp_path):
    rows = chats(10)
    rows[2]["messages"] = rows[2]["messages"][:1]
    assert "row 3 of chat.jsonl: its 'messages' has no assistant turn" in refusal(
        write_rows(tmp_path / "chat.jsonl", rows), tiny
    )


def test_a_tokenizer_without_a_chat_template_names_data_chat_template(tiny, tmp_path):
    message = refusal(write_rows(tmp_path / "chat.jsonl", chats(10)), tiny, chat_template=None)
    assert message.startswith("data.chat_template=null") and "chatml" in message


def test_an_empty_validation_split_is_refused(tiny, tmp_path):
    message = refusal(write_rows(tmp_path / "chat.jsonl", chats(10)), tiny, val_fraction=0.01)
    assert "the validation split holds" in message and "data.val_fraction" in message


def test_a_file_kind_pipeckpt_does_not_read_is_refused(tiny, tmp_path):
    (tmp_path / "rows.txt").write_text("hello\n")
    assert "pipeckpt reads no .txt file" in refusal(tmp_path / "rows.txt", tiny)


def test_rows_longer_than_seq_len_are_counted_in_one_line_and_dropped(tiny, tmp_path, capsys):
    rows = chats(40)
    rows[3]["messages"][1]["content"] = "the cat sat " * 60
    data = DatasetDataModule(
        path=str(write_rows(tmp_path / "chat.jsonl", rows)),
        tokenizer=str(tiny),
        format="chat",
        chat_template="chatml",
        seq_len=128,
        batch_size=2,
        too_long="drop",
    )
    data.setup("fit")
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "longer than seq_len" in line]
    assert line.startswith("pipeckpt: 1 of 40 rows of data.path=") and "dropped (data.too_long)" in line
    assert len(data.train_set) + len(data.val_set) == 39


def test_the_app_exits_1_naming_row_38_and_messages_without_a_traceback(tiny, tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", without(chats(50), 38, "messages"))
    done = train(
        tmp_path / "run",
        "model=hf",
        f"model.path={tiny}",
        "data=dataset",
        f"data.path={path}",
        "data.format=chat",
        "data.chat_template=chatml",
        check=False,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stdout + done.stderr
    assert "row 38 of chat.jsonl: it has no 'messages'" in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
