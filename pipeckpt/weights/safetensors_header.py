"""A safetensors file's keys and shapes, from its header alone, with the damage named.

Why: ``safe_open`` on a damaged file raises the Rust library's words (``HeaderTooLarge``,
``MetadataIncompleteBuffer``, a ``SafetensorError`` without the file's name), or for a truncated
shard nothing at all until the tensor past the end is read, mid-training on one rank. The header
says where every tensor lies; read by hand (8 bytes of length, then that much JSON) it tells, before
any tensor is read, which keys the file holds with which shapes, and whether the file is long enough
to hold them.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

from pipeckpt._errors import PipeckptCheckpointError, checkpoint_error

__all__: List[str] = []

Shape = Tuple[int, ...]
#: safetensors' own bound on a header (its ``MAX_HEADER_SIZE``): a longer one is not a header.
MAX_HEADER = 100_000_000
#: Bytes per element of each safetensors dtype (the sub-byte ones are left unchecked).
_ITEMSIZE = {
    **dict.fromkeys(("F64", "I64", "U64"), 8),
    **dict.fromkeys(("F32", "I32", "U32"), 4),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 2),
    **dict.fromkeys(("I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
}
_HINT = (
    "download or copy the file again (an interrupted transfer leaves it short), or write the "
    "directory again with save_pretrained"
)


def _damaged(file: Path, what: str, rule: str) -> PipeckptCheckpointError:
    return checkpoint_error(f"{what} {str(file)!r}", rule, _HINT)


def read_shapes(file: Path, what: str) -> Dict[str, Shape]:
    """Each key of the safetensors ``file`` -> its shape, read from the header only; ``what`` says
    which file it is to the user (``"shard"``, ``"weights file"``). Refuses, naming the file, one
    that is missing, shorter than its header or its tensors, or whose header is not safetensors'."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as stream:
            length = int.from_bytes(stream.read(8), "little")
            raw = stream.read(min(length, MAX_HEADER)) if size >= 8 else b""
    except (FileNotFoundError, NotADirectoryError):
        raise _damaged(file, what, "the file is not there") from None
    except IsADirectoryError:
        raise _damaged(file, what, "it is a directory, not a safetensors file") from None
    if size < 8:
        raise _damaged(file, what, f"it holds {size} bytes, fewer than the 8 that give its header's length")
    if length > MAX_HEADER:
        raise _damaged(
            file,
            what,
            f"its first 8 bytes give a header of {length:,} bytes, over safetensors' bound of "
            f"{MAX_HEADER:,}: this is not a safetensors file, or its start is damaged",
        )
    if length > size - 8:
        raise _damaged(
            file,
            what,
            f"its header should be {length:,} bytes, the file holds {size - 8:,} after the length: "
            "it is truncated, or not a safetensors file",
        )
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise _damaged(file, what, f"its header is not UTF-8 text (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise _damaged(
            file, what, f"its header is not valid JSON ({error.msg} at character {error.pos})"
        ) from None
    if not isinstance(header, dict):
        raise _damaged(file, what, f"its header is JSON {type(header).__name__}, not an object of tensors")
    return _shapes(file, what, header, size - 8 - length)


def _shapes(file: Path, what: str, header: Dict[str, Any], data: int) -> Dict[str, Shape]:
    """The header's entries checked against each other and the ``data`` bytes after it."""
    shapes: Dict[str, Shape] = {}
    end, last = 0, ""
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape, offsets = _entry(file, what, key, entry)
        size = _ITEMSIZE.get(entry["dtype"])
        count = 1
        for n in shape:
            count *= n
        if size is not None and offsets[1] - offsets[0] != count * size:
            raise _damaged(
                file,
                what,
                f"its header gives {key!r} shape {shape} in {entry['dtype']} ({count * size:,} bytes) "
                f"but {offsets[1] - offsets[0]:,} bytes of data (offsets {offsets})",
            )
        if offsets[1] > end:
            end, last = offsets[1], key
        shapes[key] = shape
    if end > data:
        raise _damaged(
            file,
            what,
            f"its header places {last!r} up to byte {end:,} of its data, and the file holds {data:,} "
            "bytes of data: it is truncated",
        )
    return shapes


def _entry(file: Path, what: str, key: str, entry: Any) -> Tuple[Shape, Tuple[int, int]]:
    """One header entry's shape and data offsets, refused unless they have safetensors' form."""
    ok = isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
    shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
    ints = all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in [*(shape or []), *(offsets or [])]
    )
    if not (ok and isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2 and ints):
        raise _damaged(
            file,
            what,
            f"its header's entry for {key!r} is {json.dumps(entry)[:120]}, not "
            '{"dtype": ..., "shape": [...], "data_offsets": [begin, end]}',
        )
    if offsets[0] > offsets[1]:
        raise _damaged(
            file, what, f"its header places {key!r} at offsets {offsets}, which end before they begin"
        )
    return tuple(shape), (offsets[0], offsets[1])
