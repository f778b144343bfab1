"""The DataModules: corpus reading and splitting, windows, and seeded synthetic data."""

import sysconfig
from pathlib import Path

import pytest
import torch

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.data import SyntheticImages, SyntheticTokens, SyntheticVectors, TextDataModule
from pipeckpt.app.data.text import read_corpus


def text(**kwargs) -> TextDataModule:
    kwargs.setdefault("seq_len", 16)
    kwargs.setdefault("batch_size", 4)
    dm = TextDataModule(**kwargs)
    dm.setup("fit")
    return dm


def write(folder: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content)
    return folder


def test_default_corpus_is_the_standard_library_capped_at_max_bytes():
    corpus = read_corpus(None, max_bytes=100_000)
    assert len(corpus) == 100_000
    first = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0]
    assert corpus.startswith(first.read_bytes()[:1000])


def test_corpus_reads_files_in_name_order_depth_first(tmp_path):
    write(tmp_path, {"b.py": "B", "a.py": "A", "sub/c.py": "C", "notes.txt": "N"})
    assert read_corpus(str(tmp_path), max_bytes=100) == b"ABC"


def test_corpus_skips_installed_packages(tmp_path):
    write(tmp_path, {"a.py": "A", "site-packages/x.py": "X", "dist-packages/y.py": "Y"})
    assert read_corpus(str(tmp_path), max_bytes=100) == b"A"


def test_corpus_can_be_one_file_of_any_name(tmp_path):
    file = tmp_path / "book.txt"
    file.write_text("hello world")
    assert read_corpus(str(file), max_bytes=100) == b"hello world"


def test_a_directory_without_matching_files_is_an_error_naming_it(tmp_path):
    write(tmp_path, {"notes.txt": "N"})
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        read_corpus(str(tmp_path), max_bytes=100)


def test_a_missing_path_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_corpus(str(tmp_path / "nowhere"), max_bytes=100)


def test_validation_is_the_contiguous_tail_and_training_never_sees_it():
    dm = text(max_bytes=50_000, val_fraction=0.1)
    corpus = torch.frombuffer(bytearray(read_corpus(None, max_bytes=50_000)), dtype=torch.uint8)
    assert torch.equal(dm.val_set.data, corpus[-5_000:])
    assert torch.equal(dm.train_set.data, corpus[:-5_000])
    _, last_y = dm.train_set[len(dm.train_set) - 1]
    assert torch.equal(last_y[-1:].to(torch.uint8), corpus[-5_001:-5_000])


def test_windows_are_inputs_and_targets_shifted_by_one():
    dm = text(max_bytes=20_000)
    x, y = dm.train_set[123]
    assert x.shape == y.shape == (16,)
    assert x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])


def test_training_uses_every_offset_and_validation_tiles_without_overlap():
    dm = text(max_bytes=20_000, val_fraction=0.1)
    assert len(dm.train_set) == 18_000 - 16
    assert len(dm.val_set) == (2_000 - 17) // 16 + 1
    assert torch.equal(dm.val_set[1][0][0], dm.val_set.data[16].long())


def test_a_validation_split_smaller_than_a_batch_is_refused_naming_the_settings():
    with pytest.raises(PipeckptConfigError) as error:
        text(max_bytes=2_000, val_fraction=0.05, batch_size=16)
    message = str(error.value)
    assert message.startswith(
        "data.batch_size=16: the validation split holds 6 windows, fewer than one batch"
    )
    assert "data.max_bytes" in message and "data.val_fraction" in message


def test_text_batches_have_the_configured_shape():
    x, y = next(iter(text(max_bytes=20_000).train_dataloader()))
    assert x.shape == y.shape == (4, 16)


@pytest.mark.parametrize("cls", [SyntheticTokens, SyntheticVectors, SyntheticImages])
def test_synthetic_data_is_a_function_of_the_seed(cls):
    def data(seed):
        dm = cls(seed=seed, num_samples=64, val_samples=32, batch_size=16)
        dm.setup("fit")
        return dm.train_set.tensors

    assert all(torch.equal(a, b) for a, b in zip(data(0), data(0)))
    assert not torch.equal(data(0)[0], data(1)[0])


def test_synthetic_tokens_are_arithmetic_sequences_shifted_by_one():
    dm = SyntheticTokens(seq_len=8, vocab_size=256, num_samples=16, val_samples=16, batch_size=4)
    dm.setup("fit")
    x, y = dm.train_set.tensors
    step = (x[:, 1] - x[:, 0]) % 256
    assert torch.equal((x[:, :1] + step[:, None] * torch.arange(8)) % 256, x)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_synthetic_vectors_and_images_share_their_task_between_train_and_validation():
    dm = SyntheticImages(noise=0.0, num_classes=3, num_samples=32, val_samples=32, batch_size=8)
    dm.setup("fit")
    (xt, yt), (xv, yv) = dm.train_set.tensors, dm.val_set.tensors
    # Without noise an image is its class prototype, the same in both splits.
    assert torch.equal(xt[yt == 0][0], xv[yv == 0][0])


def test_synthetic_data_needs_a_full_batch():
    with pytest.raises(ValueError, match="val_samples"):
        SyntheticVectors(num_samples=64, val_samples=8, batch_size=16)
