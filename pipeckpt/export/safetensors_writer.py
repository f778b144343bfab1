"""A safetensors file written one tensor at a time, each dropped by its producer once written.

Why not ``safetensors.torch.save_file``: it takes a dict of every tensor of the file, so the export
had to hold a whole shard before writing a byte of it (and, through DCP's reader, one more stored
tensor beside it); safetensors has no streaming writer (its header names every tensor's offsets, so
its API wants them all at once). The header needs only each tensor's dtype and shape, which the
export knows from the checkpoint's metadata before reading any bytes: this module writes the header
from that ``layout``, then each tensor's bytes as the caller hands it over, in the layout's order.
Files load with ``safetensors.safe_open`` / ``load_file`` like ``save_file``'s (tests/export).

The format: an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with spaces to a multiple of 8, then
the tensors' raw little-endian bytes in offset order, with no holes.
"""

import json
import os
import struct
import sys
from typing import Dict, Iterable, Mapping, Optional, Tuple, Union

import torch

__all__ = ["write_file"]

PathLike = Union[str, "os.PathLike[str]"]
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _header(layout: Mapping[str, torch.Tensor], metadata: Optional[Dict[str, str]]) -> bytes:
    entries: Dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    offset = 0
    for name, tensor in layout.items():
        if tensor.dtype not in _DTYPES:
            raise TypeError(
                f"{name}: safetensors_writer writes {sorted(map(str, _DTYPES))}, not {tensor.dtype}"
            )
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(
    path: PathLike,
    layout: Mapping[str, torch.Tensor],
    tensors: Iterable[Tuple[str, torch.Tensor]],
    metadata: Optional[Dict[str, str]] = None,
) -> None:
    """Writes the safetensors file ``path`` holding ``layout``'s names with its dtypes and shapes
    (tensors on the meta device will do), their values taken from ``tensors``: ``(name, tensor)``
    pairs in the layout's order (a generator, so that each tensor is freed once written)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors_writer writes the host's bytes, and safetensors' are little-endian")
    names = iter(layout)
    with open(path, "wb") as f:
        f.write(_header(layout, metadata))
        for name, tensor in tensors:
            expected = next(names, None)
            want = layout.get(name)
            if name != expected or want is None or tensor.dtype != want.dtype or tensor.shape != want.shape:
                raise ValueError(
                    f"safetensors_writer: got {name!r} {tensor.dtype} {tuple(tensor.shape)} where the "
                    f"layout has {expected!r} next"
                    + (f" ({want.dtype} {tuple(want.shape)})" if want is not None else "")
                )
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            f.write(data.numpy().data)
            del tensor, data
        left = next(names, None)
        if left is not None:
            raise ValueError(f"safetensors_writer: no tensor given for {left!r} (and any after it)")
