"""A safetensors tensor read by plain reads of its byte ranges (pipeckpt/weights/ranged_read.py):
bitwise what ``safe_open`` gives, whole or any block of it, in buffers of a few rows, converted to
the destination's dtype; the buffer, not the tensor, bounds what is held at once."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeckpt.weights import ranged_read
from pipeckpt.weights.ranged_read import SafetensorsFile


@pytest.fixture
def file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "matrix": torch.randn(37, 11, generator=g).to(torch.bfloat16),
        "cube": torch.randn(5, 6, 7, generator=g),
        "vector": torch.randn(29, generator=g).to(torch.float16),
        "scalar": torch.tensor(3.25),
        "ids": torch.arange(40, dtype=torch.int64).reshape(8, 5),
        "flags": torch.tensor([True, False, True]),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    return path


def _expected(path, key):
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


@pytest.mark.parametrize("chunk", [1, 30, 64, 2**20])
@pytest.mark.parametrize("key", ["matrix", "cube", "vector", "scalar", "ids", "flags"])
def test_a_whole_tensor_equals_safe_open_bitwise_in_any_buffer_size(file, key, chunk, monkeypatch):
    monkeypatch.setattr(ranged_read, "CHUNK", chunk)
    want = _expected(file, key)
    dest = torch.empty(want.shape, dtype=want.dtype)
    with SafetensorsFile(file) as f:
        assert f.shape(key) == tuple(want.shape) and f.readable(key)
        f.read_into(dest, key, (0,) * want.dim())
    assert torch.equal(dest, want)


@pytest.mark.parametrize("chunk", [1, 50, 2**20])
@pytest.mark.parametrize(
    "key, offset, shape",
    [
        ("matrix", (19, 0), (18, 11)),  # rows: an FSDP shard
        ("matrix", (0, 6), (37, 5)),  # columns: a tensor-parallel split
        ("matrix", (3, 2), (10, 4)),
        ("cube", (2, 3, 1), (2, 3, 6)),
        ("vector", (15,), (14,)),
    ],
)
def test_a_block_equals_the_same_slice_of_safe_open_converted_to_float32(
    file, key, offset, shape, chunk, monkeypatch
):
    monkeypatch.setattr(ranged_read, "CHUNK", chunk)
    block = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    want = _expected(file, key)[block].to(torch.float32)
    dest = torch.full(shape, float("nan"))
    with SafetensorsFile(file) as f:
        f.read_into(dest, key, offset)
    assert torch.equal(dest, want)


def test_the_buffer_holds_at_most_chunk_bytes_of_a_tensor_larger_than_it(file, monkeypatch):
    monkeypatch.setattr(ranged_read, "CHUNK", 64)  # 2 rows of the 37 x 11 bf16 matrix (22 bytes a row)
    with SafetensorsFile(file) as f:
        f.read_into(torch.empty(37, 11), "matrix", (0, 0))
        assert f._buffer is not None and len(f._buffer) == 64
