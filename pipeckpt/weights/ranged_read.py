"""A tensor of a safetensors file read into its destination a few MiB at a time, by plain reads of
the byte ranges it needs, never by mapping the file.

Why: ``safe_open`` maps the whole file; every page a read touches counts as the process's resident
memory until the file is closed, beside the tensor (or slice) the library returns in the file's
dtype. Reading one key's slice that way raised a process's peak by the slice's size in the file's
dtype (31 MiB for an FSDP rank's half of a 0.168e9 Llama's bf16 embedding; 62 MiB for its whole bf16
head under pp2), over the 15% of what it holds that a process may add at train start
(benchmarks/RESULTS.md). Here the rows a rank holds (contiguous in the file: safetensors stores
tensors row-major, little-endian) are read with ``readinto`` into one reused buffer of at most
:data:`CHUNK` bytes and converted into the destination block by block: the transient is the
buffer, whatever the tensor's size.
"""

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__: List[str] = []

#: The most bytes of the file held at once while reading one tensor (at least one row of it). Not
#: more: glibc keeps a freed buffer of a few MiB in its heap (4 MiB measured the rank's RSS 4 MiB
#: higher at train start, on the 1.15 bound's edge under pp2 x fsdp2; 1 MiB, 2-6 MiB under it).
CHUNK = 2**20
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """One safetensors file opened for plain reads (no mapping): its header's entries, and
    :meth:`read_into` for a key whose dtype torch reads from the raw bytes."""

    def __init__(self, file: Path) -> None:
        self.stream = open(file, "rb", buffering=0)
        length = int.from_bytes(self.stream.read(8), "little")
        self.entries: Dict[str, Any] = json.loads(self.stream.read(length).decode("utf-8"))
        self.start = 8 + length
        self._buffer: Optional[bytearray] = None

    def close(self) -> None:
        self.stream.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def readable(self, key: str) -> bool:
        """Whether :meth:`read_into` reads ``key`` (a dtype torch has, on a little-endian machine)."""
        return sys.byteorder == "little" and self.entries[key]["dtype"] in _DTYPES

    def read_into(self, dest: Tensor, key: str, offset: Sequence[int]) -> None:
        """``key``'s block of ``dest.shape`` starting at ``offset`` (zeros: the whole tensor) copied into
        ``dest``, converting the dtype, through a buffer of at most :data:`CHUNK` bytes (one row
        where a row is larger)."""
        entry = self.entries[key]
        dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin = self.start + entry["data_offsets"][0]
        if not shape:  # a scalar: one element
            dest.copy_(self._read(begin, dtype.itemsize, dtype, (1,)).reshape(()))
            return
        row = dtype.itemsize
        for n in shape[1:]:
            row *= n
        first, rows = offset[0], dest.shape[0]
        step = max(1, CHUNK // max(row, 1))
        index = (slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], dest.shape[1:])))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            block = self._read(begin + (first + r) * row, n * row, dtype, (n, *shape[1:]))
            dest[r : r + n].copy_(block[index])

    def _read(self, position: int, size: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> Tensor:
        """``size`` bytes of the file from ``position``, as a tensor of ``shape`` over the buffer."""
        if self._buffer is None or len(self._buffer) < size:
            self._buffer = bytearray(max(size, min(CHUNK, 2**16)))
        view = memoryview(self._buffer)[:size]
        self.stream.seek(position)
        done = 0
        while done < size:
            got = self.stream.readinto(view[done:])
            if not got:
                raise EOFError(f"{self.stream.name!r} ends {size - done} bytes before its tensor does")
            done += got
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._buffer, dtype=dtype, count=size // dtype.itemsize).view(shape)
