"""``data=hf_text`` without a tokenizer (issue 45): a model's directory that holds none trains on the
text's bytes, and the run says so in one line naming the directory and ``data.tokenizer``; bytes
asked for (``data.tokenizer=null``) are not remarked on."""

from pathlib import Path

from pipeckpt.app.data.hf_text import HFTextDataModule


def _setup(tmp_path: Path, tokenizer) -> None:
    (tmp_path / "corpus.py").write_bytes(b"def f(x):\n    return x + 1\n" * 40)
    kwargs = dict(path=str(tmp_path / "corpus.py"), seq_len=16, batch_size=1, val_fraction=0.1)
    HFTextDataModule(tokenizer=tokenizer, **kwargs).setup("fit")


def test_a_directory_without_a_tokenizer_says_in_one_line_that_the_ids_are_bytes(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    _setup(tmp_path, str(model))
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pipeckpt:")]
    assert len(said) == 1, said
    assert f"{model} holds no tokenizer" in said[0] and "bytes" in said[0] and "data.tokenizer" in said[0]


def test_bytes_asked_for_with_no_tokenizer_are_not_remarked_on(tmp_path, capsys):
    _setup(tmp_path, None)
    assert "pipeckpt:" not in capsys.readouterr().out
