"""Checkpoint files read without running anything they name, and refused in pipeckpt's words.

Why: a pickle can name any callable, and unpickling calls it. Files written with ``torch.save``
(single-file checkpoints, a sharded checkpoint's rank-0 part and its byte items) are read with
torch's weights-only unpickler; DCP's ``.metadata`` is a plain pickle, read here by an unpickler
that admits exactly DCP's metadata classes. A file that needs anything else, or that is no
checkpoint at all (random bytes, cut short), is refused naming the file and what is wrong,
instead of torch's advice to load it with ``weights_only=False``.
"""

import io
import os
import pathlib
import pickle
import re
import zipfile
from contextlib import contextmanager
from functools import lru_cache
from typing import IO, Any, Callable, FrozenSet, Generator, List, Optional, Tuple, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from pipeckpt._compat import DcpMemoryFormat, DcpStorageInfo, layout_by_name
from pipeckpt._errors import PipeckptCheckpointError, checkpoint_error
from pipeckpt.state import confined

__all__ = [
    "SafeLoadPlanner",
    "SafeReader",
    "load_torch_file",
    "load_with",
    "read_dcp_metadata",
    "refused",
    "translated",
    "weights_only_load",
]

PathLike = Union[str, "os.PathLike[str]"]
_ZIP = b"PK\x03\x04"  # torch.save's format since torch 1.6
_PICKLE = 0x80  # a pickle's PROTO opcode: the legacy torch.save format
_TRUST_HINT = (
    "load only checkpoints written by Lightning or pipeckpt from a source you trust; if you wrote "
    "this file yourself with that object in it, allow its class with "
    "torch.serialization.add_safe_globals([...]) before loading"
)


def refused(path: PathLike, what: str, hint: str = _TRUST_HINT) -> PipeckptCheckpointError:
    """The refusal of a file that holds ``what`` (a class or function), which loading would call."""
    return checkpoint_error(
        f"checkpoint file {os.fspath(path)!r} holds {what}",
        "loading it would call that, and a checkpoint is loaded only if it holds tensors and plain "
        "data (torch's weights-only rule); nothing in it was run",
        hint,
    )


def _refused_name(error: BaseException) -> str:
    """The global torch's weights-only unpickler refused, from its message (it names it after
    ``GLOBAL``); the message's last line where it names none."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    if found:
        return found.group(1)
    lines = [line for line in str(error).splitlines() if line.strip()]
    return (
        f"something torch's weights-only unpickler refuses ({lines[-1] if lines else type(error).__name__})"
    )


def _damaged(path: PathLike, how: str) -> PipeckptCheckpointError:
    return checkpoint_error(
        f"checkpoint file {os.fspath(path)!r}",
        how,
        "pass a complete checkpoint: copy it again, or resume from another one (last.ckpt, or an "
        "earlier epoch=...-step=....ckpt)",
    )


def check_torch_file(path: PathLike) -> None:
    """Refuses a local file that cannot be a complete ``torch.save`` file, before torch reads it:
    empty, cut short (a zip archive without its directory), or no checkpoint at all."""
    with open(path, "rb") as file:
        head = file.read(4)
    if not head:
        raise _damaged(path, "is empty (0 bytes): a copy or a save that stopped before writing")
    if head == _ZIP:
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except zipfile.BadZipFile:
            raise _damaged(
                path, "is truncated or damaged: its zip archive ends without its directory"
            ) from None
        if not any(name.endswith("data.pkl") for name in names):
            raise _damaged(path, "is a zip archive but not a torch.save checkpoint (no data.pkl in it)")
        return
    if head[0] != _PICKLE:
        raise _damaged(
            path,
            f"is not a checkpoint: a torch.save file begins with a zip or pickle header, this one "
            f"with bytes {head.hex(' ')}",
        )


def translated(path: PathLike, error: BaseException) -> Optional[PipeckptCheckpointError]:
    """pipeckpt's words for what a weights-only ``torch.load`` of ``path`` raised; None when the
    error is not about the file."""
    if isinstance(error, pickle.UnpicklingError):
        if "GLOBAL" in str(error):
            return refused(path, _refused_name(error))
        return _damaged(path, f"cannot be read as a checkpoint ({_refused_name(error)})")
    if isinstance(error, EOFError):
        return _damaged(path, "ends in the middle of its data (truncated)")
    if isinstance(error, RuntimeError) and "PytorchStreamReader" in str(error):
        return _damaged(path, "is damaged: torch cannot read its archive")
    return None


def weights_only_load(path: PathLike, load: Callable[[], Any]) -> Any:
    """``load()`` (a weights-only ``torch.load`` of ``path``), its refusals in pipeckpt's words."""
    try:
        return load()
    except (pickle.UnpicklingError, EOFError, RuntimeError) as error:
        mine = translated(path, error)
        if mine is None:
            raise
        raise mine from None


def load_torch_file(path: PathLike, *, weights_only: Optional[bool] = None, mmap: bool = False) -> Any:
    """``torch.load(path)`` onto the CPU, weights-only unless the caller passes ``weights_only=False``
    (a file it trusts), after :func:`check_torch_file`; ``mmap``: tensors map the file and are read
    only where touched (a reader that wants a few of them at a time)."""
    check_torch_file(path)
    safe = weights_only is not False
    return weights_only_load(path, lambda: torch.load(path, map_location="cpu", weights_only=safe, mmap=mmap))


def load_with(io: Any, path: Any, weights_only: Optional[bool]) -> Any:
    """A single-file checkpoint through Lightning's ``CheckpointIO`` ``io``, weights-only unless the
    caller passes ``weights_only=False``; a local file is checked first (:func:`check_torch_file`)."""
    local = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if local is not None and "://" not in local and os.path.isfile(local):
        check_torch_file(local)
    safe = weights_only is not False
    return weights_only_load(path, lambda: io.load_checkpoint(path, weights_only=safe))


# -- DCP's .metadata --------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _metadata_globals() -> FrozenSet[Tuple[str, str]]:
    """Every (module, name) DCP's metadata pickle may name: its dataclasses, the memory-format enum,
    layouts and dtypes, ``torch.Size`` and the checkpoint's path."""
    classes: List[Any] = [
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        StorageMeta,
        MetadataIndex,
        DcpStorageInfo,
        DcpMemoryFormat,
        layout_by_name,
        torch.Size,
        pathlib.PurePosixPath,
        pathlib.PosixPath,
        pathlib.PureWindowsPath,
        pathlib.WindowsPath,
    ]
    names = {(c.__module__, c.__qualname__) for c in classes}
    names |= {("pathlib", c.__name__) for c in classes[-4:]}  # pickled under another module elsewhere
    names |= {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    return frozenset(names)


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, and refuses anything else before it is called."""

    def __init__(self, file: IO[bytes], path: PathLike) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _metadata_globals():
            return super().find_class(module, name)
        raise refused(
            self.path,
            f"{module}.{name}",
            "a DCP .metadata file holds only DCP's own metadata classes: this one was altered or was "
            "not written by torch.distributed.checkpoint; resume from a checkpoint you trust",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise refused(self.path, f"a persistent id {pid!r}", "resume from a checkpoint you trust")


def read_dcp_metadata(path: PathLike) -> Metadata:
    """DCP's ``.metadata`` at ``path``, read by :class:`_MetadataUnpickler`."""
    with open(path, "rb") as file:
        try:
            metadata = _MetadataUnpickler(file, path).load()
        except PipeckptCheckpointError:
            raise
        except Exception as error:  # random bytes, cut short: whatever pickle trips on
            raise _damaged(
                path, f"is not a readable DCP .metadata file ({type(error).__name__}: {error})"
            ) from None
    if not isinstance(metadata, Metadata):
        raise _damaged(path, f"holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


# -- DCP's reader and planner -------------------------------------------------------------------


class _RecordingFileSystem(FileSystem):
    """DCP's local file system, remembering the file it opened last (to name it in a refusal)."""

    opened: Optional[str] = None

    @contextmanager
    def create_stream(
        self, path: Union[str, "os.PathLike[str]"], mode: str
    ) -> Generator[io.IOBase, None, None]:
        self.opened = os.fspath(path)
        with super().create_stream(path, mode) as stream:
            yield stream


def _key_of(metadata: Metadata) -> Callable[[str], str]:
    """The module's own key of DCP's flat key ``fqn`` where the checkpoint maps it (a model entry),
    else ``fqn``."""
    nested = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}

    def key_of(fqn: str) -> str:
        path = nested.get(fqn)
        return str(path[1]) if isinstance(path, tuple) and len(path) == 2 else fqn

    return key_of


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_dcp_metadata`, that opens no file
    outside its directory (:mod:`pipeckpt.state.confined`: every file the metadata names is checked
    before any is read), and whose refusals of a shard's content (with :class:`SafeLoadPlanner`)
    name the shard file. ``metadata``: the directory's index as this reader's ``read_metadata`` read
    it before, handed back instead of read again."""

    def __init__(self, path: PathLike, *, metadata: Optional[Metadata] = None) -> None:
        super().__init__(path)
        self.recording = _RecordingFileSystem()
        self.fs = self.recording
        self.known = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if self.known is not None and rank is None:
            metadata = self.known
        else:
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            index = confined.inside(self.path, name, "DCP's index of the shards")
            metadata = read_dcp_metadata(index)
            confined.require_inside(self.path, confined.storage_files(self.path, metadata, _key_of(metadata)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except (pickle.UnpicklingError, EOFError, RuntimeError) as error:
            mine = translated(self.recording.opened or os.fspath(self.path), error)
            if mine is None:
                raise
            raise mine from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but byte items (objects other than tensors) are read weights-only:
    the default reads them with ``weights_only=False``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        node: Any = self.original_state_dict
        path = self.mappings[fqn]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = obj
