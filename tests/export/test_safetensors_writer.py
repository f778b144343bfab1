"""pipeckpt.export.safetensors_writer: files written tensor by tensor load with safetensors' own
reader bitwise equal to what was written, for every dtype an export writes, empty and 0-d tensors
included, with their metadata; a tensor out of the layout's order, or a missing one, is refused."""

from pathlib import Path
from typing import Dict

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipeckpt.export.safetensors_writer import write_file


def _tensors() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.f32": torch.randn(3, 5, generator=g),
        "w.bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(2, 2, 2, generator=g).to(torch.float16),
        "buf.i64": torch.randint(-(2**40), 2**40, (4,), generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "mask": torch.tensor([True, False, True]),
    }


def _write(path: Path, tensors: Dict[str, torch.Tensor], metadata=None) -> None:
    layout = {k: v.to("meta") for k, v in tensors.items()}
    write_file(path, layout, ((k, v.clone()) for k, v in tensors.items()), metadata=metadata)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


def test_load_file_reads_back_every_dtype_bitwise_equal(tmp_path):
    tensors = _tensors()
    _write(tmp_path / "x.safetensors", tensors)
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert _bitwise_equal(loaded[name], tensor), name


def test_safe_open_reads_the_metadata_and_each_tensor(tmp_path):
    tensors = _tensors()
    _write(tmp_path / "x.safetensors", tensors, metadata={"format": "pt"})
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            assert _bitwise_equal(f.get_tensor(name), tensor), name


def test_the_file_holds_the_same_tensors_as_save_files(tmp_path):
    tensors = _tensors()
    _write(tmp_path / "ours.safetensors", tensors, metadata={"format": "pt"})
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    ours, theirs = (
        load_file(str(tmp_path / "ours.safetensors")),
        load_file(str(tmp_path / "theirs.safetensors")),
    )
    header = int.from_bytes((tmp_path / "ours.safetensors").read_bytes()[:8], "little")
    assert header % 8 == 0  # the data starts 8-byte aligned, as the format asks
    for name in tensors:
        assert _bitwise_equal(ours[name], theirs[name]), name


def test_a_tensor_out_of_the_layouts_order_is_refused(tmp_path):
    tensors = _tensors()
    layout = {k: v.to("meta") for k, v in tensors.items()}
    with pytest.raises(ValueError, match=r"'w\.bf16'.*'w\.f32' next"):
        write_file(tmp_path / "x.safetensors", layout, [("w.bf16", tensors["w.bf16"])])


def test_a_tensor_of_another_dtype_than_the_layouts_is_refused(tmp_path):
    layout = {"w": torch.empty(2, device="meta")}
    with pytest.raises(ValueError, match=r"'w' torch\.float16"):
        write_file(tmp_path / "x.safetensors", layout, [("w", torch.zeros(2, dtype=torch.float16))])


def test_a_missing_tensor_is_refused(tmp_path):
    tensors = _tensors()
    layout = {k: v.to("meta") for k, v in tensors.items()}
    with pytest.raises(ValueError, match=r"no tensor given for 'w\.bf16'"):
        write_file(tmp_path / "x.safetensors", layout, [("w.f32", tensors["w.f32"])])
