"""What a pretrained checkpoint holds: each key, the file it lies in and its shape, before any read.

Why: a module is checked against its checkpoint (:mod:`.matching`) on the keys and shapes alone,
and each process then opens only the files of its own keys. Both come from the index and the
safetensors headers (:mod:`.safetensors_header`), never from a tensor. The headers are the truth:
``from_pretrained`` reads each shard's own keys and uses the index only for the list of shards, so
an index entry naming a shard that does not hold its key is followed to the one shard that does
(with a warning: ``from_pretrained`` itself would leave that weight to random initialisation), and
refused when no shard or several shards hold it.
"""

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import Tensor

from pipeckpt._errors import PipeckptCheckpointError, PipeckptWarning, checkpoint_error, config_error
from pipeckpt.state.safe_load import weights_only_load
from pipeckpt.weights.confinement import within
from pipeckpt.weights.safetensors_header import Shape, read_shapes

__all__: List[str] = []

INDEX, SINGLE, TORCH = "model.safetensors.index.json", "model.safetensors", "pytorch_model.bin"
_INDEX_HINT = "write the directory again with save_pretrained, or restore the index from where it came"


@dataclass
class Listing:
    """A checkpoint's keys: the file holding each, its shape, and for a torch state-dict file the
    state dict itself (mapped, not read)."""

    where: Dict[str, Path] = field(default_factory=dict)
    shapes: Dict[str, Shape] = field(default_factory=dict)
    state: Optional[Dict[str, Tensor]] = None


def list_checkpoint(path: Path) -> Listing:
    """The listing of ``path``: a directory holding :data:`INDEX` and its shards, :data:`SINGLE` or
    :data:`TORCH`, or one such file (a file named directly is the user's choice, not confined)."""
    if path.is_dir() and (path / INDEX).exists():
        return _sharded(path)
    name = next((n for n in (SINGLE, TORCH) if (path / n).exists()), None) if path.is_dir() else None
    if path.is_dir() and name is None:
        raise config_error(
            f"pretrained checkpoint {str(path)!r}",
            f"a pretrained checkpoint is a directory holding {INDEX} (with its shards), {SINGLE} "
            f"or {TORCH}, or one such file; this is a directory without them",
            "pass the directory save_pretrained wrote, or the state-dict file",
        )
    file = within(path, name, f"the weights file {name}") if name is not None else path
    if not file.is_file():
        raise config_error(
            f"pretrained checkpoint {str(path)!r}",
            f"a pretrained checkpoint is a directory holding {INDEX} (with its shards), {SINGLE} "
            f"or {TORCH}, or one such file; this is no file",
            "pass the directory save_pretrained wrote, or the state-dict file",
        )
    if file.suffix == ".safetensors":
        shapes = read_shapes(file, "weights file")
        return Listing(dict.fromkeys(shapes, file), shapes)
    state = weights_only_load(  # refusals of a pickled object in pipeckpt's words
        file, lambda: torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    )
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise config_error(
            f"pretrained checkpoint {str(file)!r}",
            "a file that is not safetensors must hold a state dict (names -> tensors)",
            "save model.state_dict() with torch.save, or pass a save_pretrained directory",
        )
    return Listing(dict.fromkeys(state, file), {k: tuple(v.shape) for k, v in state.items()}, state)


def _weight_map(index: Path) -> Dict[str, str]:
    """The index's ``weight_map`` (key -> shard name), refused by name when it is not one."""
    what = f"index {str(index)!r}"
    try:
        parsed = json.loads(index.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise checkpoint_error(what, f"it is not UTF-8 text (byte {error.start})", _INDEX_HINT) from None
    except json.JSONDecodeError as error:
        raise checkpoint_error(
            what,
            f"it is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})",
            _INDEX_HINT,
        ) from None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise checkpoint_error(
            what,
            'it holds no "weight_map" object of key -> shard file name, as save_pretrained writes',
            _INDEX_HINT,
        )
    return weight_map


def _sharded(path: Path) -> Listing:
    index = within(path, INDEX, "the index")
    weight_map = _weight_map(index)
    names = sorted(set(weight_map.values()))
    files = {n: within(path, n, f"{INDEX}'s weight_map") for n in names}  # all checked, then read
    headers = {n: read_shapes(files[n], "shard") for n in names}
    holders: Dict[str, List[str]] = {}
    for name in names:
        for key in headers[name]:
            holders.setdefault(key, []).append(name)
    listing = Listing()
    for key in sorted(set(weight_map) | set(holders)):
        if key not in holders:  # an edited index may have lost its shard: look among the others
            _unlisted(path, files, headers)
        held = [n for n in headers if key in headers[n]]
        name = _holder(index, key, weight_map.get(key), held)
        listing.where[key], listing.shapes[key] = files[name], headers[name][key]
    return listing


def _unlisted(path: Path, files: Dict[str, Path], headers: Dict[str, Dict[str, Shape]]) -> None:
    """Adds to ``files`` and ``headers`` the directory's other safetensors files (once), leaving out
    any that lies outside it or is damaged: the index does not call them part of the checkpoint."""
    for file in sorted(path.glob("*.safetensors")):
        if file.name in headers:
            continue
        try:
            files[file.name] = within(path, file.name, "a shard the index does not list")
            headers[file.name] = read_shapes(files[file.name], "shard")
        except PipeckptCheckpointError:
            files.pop(file.name, None)
            headers[file.name] = {}


def _holder(index: Path, key: str, named: Optional[str], held: List[str]) -> str:
    """The shard to read ``key`` from: the one the index names if it holds the key, else the one
    shard that does."""
    if named in held:
        return named
    if len(held) == 1:
        if named is not None:
            warnings.warn(
                f"{str(index)!r} maps {key!r} to {named!r}, which does not hold it; reading it from "
                f"{held[0]!r}, the one shard that does (from_pretrained would initialise it at random)",
                PipeckptWarning,
                stacklevel=4,
            )
        return held[0]
    rule = (
        f"it maps {key!r} to the shard {named!r}, whose header does not hold it, nor does any other shard"
        if not held
        else f"the shards {held} all hold {key!r} and the index names {named!r}: which is meant is unknown"
    )
    raise checkpoint_error(f"index {str(index)!r}", rule, _INDEX_HINT)
