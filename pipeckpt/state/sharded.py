"""Sharded checkpoint directories for the distributed engine, written with torch.distributed.checkpoint.

Why not ``torch.save`` on one rank: gathering the whole model and optimizer state cannot scale past
one host's memory. Every rank writes its own tensors through DCP, and global rank 0 adds the small rest
of Lightning's checkpoint as one file (:data:`META_FILE`), as Lightning's FSDP strategy does. Keys are
the unpipelined module's and optimizer state is keyed by parameter name, so a checkpoint resumes
under any layout; :func:`to_torch_save` makes it one file. A directory is written aside and appears
at its path in one rename.
"""

from __future__ import annotations

import itertools
import os
import shutil
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from pipeckpt._compat import dcp_file_extents
from pipeckpt._errors import (
    PipeckptCheckpointError,
    PipeckptConfigError,
    PipeckptSaveError,
    checkpoint_error,
    config_error,
)
from pipeckpt.state import safe_load
from pipeckpt.state.directories import swap_into_place, temporary_beside
from pipeckpt.state.files import atomic_write
from pipeckpt.state.optimizer_names import optimizer_state_by_index, optimizer_state_by_name
from pipeckpt.state.save_errors import NamingWriter, checkpoint_bytes, named, not_written
from pipeckpt.state.sharded_index import DCP_METADATA as _DCP_METADATA
from pipeckpt.state.sharded_index import META_FILE, ShardedIndex, read_index

__all__ = [
    "META_FILE",
    "is_sharded",
    "load",
    "optimizer_state_by_index",
    "optimizer_state_by_name",
    "require_sharded",
    "save",
    "to_torch_save",
]

_FORMAT_KEY, _FORMAT = "pipeckpt_sharded_format", 1
_MODEL, _OPTIM = "state_dict", "optimizer_states"  # top-level keys of the DCP state dict
_NO_DIST = "torch.distributed is disabled"  # DCP warns so whenever it runs in one process


# -- save ----------------------------------------------------------------------------------------


def _tensors_to_write(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's tensors under DCP's nested keys, refusing what cannot be written."""
    model = dict(checkpoint.get(_MODEL, {}))
    meta = [key for key, value in model.items() if isinstance(value, torch.Tensor) and value.is_meta]
    if meta:
        raise config_error(
            f"state_dict keys {meta[:5]} on the meta device",
            "a rank passes only the tensors it holds",
            "drop the keys of other ranks' stages (their tensors are on meta) before sharded.save",
        )
    optimizers: dict[str, Any] = {}
    for number, optimizer in enumerate(checkpoint.get(_OPTIM, [])):
        by_index = [key for key in optimizer["state"] if not isinstance(key, str)]
        if by_index:
            raise config_error(
                f"optimizer_states[{number}]['state'] keys {by_index[:5]}",
                "sharded checkpoints key optimizer state by parameter name, not position",
                "convert with pipeckpt.state.sharded.optimizer_state_by_name(optimizer.state_dict(), names)",
            )
        optimizers[str(number)] = dict(optimizer["state"])
    return {_MODEL: model, _OPTIM: optimizers}


def _metadata(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0's checkpoint without the tensors that the shards hold."""
    meta = {key: value for key, value in checkpoint.items() if key not in (_MODEL, _OPTIM)}
    if _OPTIM in checkpoint:
        meta[_OPTIM] = [{k: v for k, v in opt.items() if k != "state"} for opt in checkpoint[_OPTIM]]
    meta[_FORMAT_KEY] = _FORMAT
    return meta


def save(
    checkpoint: Mapping[str, Any], path: str | os.PathLike, *, group: ProcessGroup | None = None
) -> None:
    """Writes ``checkpoint`` as a sharded directory at ``path``; a collective over ``group``
    (default: the default group; none initialised: this process alone).

    On each rank ``checkpoint["state_dict"]`` holds that rank's tensors (never meta ones) under the
    unpipelined module's keys, and ``checkpoint["optimizer_states"][i]["state"]`` that rank's
    parameters' state keyed by name (:func:`optimizer_state_by_name`). Replicas may hold the same keys:
    each tensor is written once. Every other entry is taken from the group's rank 0. The directory is
    written beside ``path`` and renamed onto it once every rank has finished; an older checkpoint at
    ``path`` stays whole until then and is removed after. Raises on every rank if any rank fails.
    """
    target = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    is_zero = not distributed or dist.get_rank(group) == 0
    refusal: BaseException | None = None
    try:
        tensors = _tensors_to_write(checkpoint)
    except PipeckptConfigError as error:
        refusal, tensors = error, {}
    tmp: str | None = None
    if is_zero and refusal is None:
        try:
            tmp = temporary_beside(target)
        except OSError as error:  # a read-only or forbidden directory, named on every rank
            refusal = named(error, target, who="rank 0") or error
    sizes = [checkpoint_bytes(tensors)]
    if distributed:  # agree on the directory, and stop together when one rank's input is refused
        everyone: list[Any] = [None] * dist.get_world_size(group)
        mine = None if refusal is None else (str(refusal), getattr(refusal, "errno", None))
        dist.all_gather_object(everyone, (tmp, mine, sizes[0]), group=group)
        tmp, sizes = everyone[0][0], [size for _, _, size in everyone]
        refused_by = [(rank, why) for rank, (_, why, _) in enumerate(everyone) if why is not None]
        if refusal is None and refused_by:
            rank, (why, code) = refused_by[0]
            refusal = (
                PipeckptConfigError(f"rank {rank} of the group: {why}")
                if code is None
                else PipeckptSaveError(code, why)
            )
    if refusal is not None:
        raise refusal
    assert tmp is not None
    _write(
        tensors, sizes, Path(tmp), checkpoint, target, distributed=distributed, is_zero=is_zero, group=group
    )


def _write(
    tensors: dict[str, Any],
    sizes: list[int],
    tmp: Path,
    checkpoint: Mapping[str, Any],
    target: Path,
    *,
    distributed: bool,
    is_zero: bool,
    group: ProcessGroup | None,
) -> None:
    """Every rank's shards into ``tmp`` (DCP), then rank 0's part and the rename onto ``target``.
    A failure is raised on every rank as this rank's own (outside DCP's collective that told it),
    naming the rank whose write failed first; ``sizes``: each rank's bytes of tensors."""
    failed: BaseException | None = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST)
            dcp.save(
                tensors,
                storage_writer=NamingWriter(tmp, sync_files=True, overwrite=False),
                process_group=group,
                no_dist=not distributed,
            )
    except BaseException as error:  # DCP raises on every rank when one fails
        if is_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(error, dcp.CheckpointException):  # a BaseException: `except Exception` misses it
            raise
        failed = not_written(target, error.failures, sizes, str(error))
    if failed is not None:
        raise failed
    failure: tuple[int | None, str] | None = None  # (errno of a refusal, message)
    if is_zero:
        try:
            # Rank 0's part; atomic_write also makes the directory's entries (DCP's files) durable.
            atomic_write(tmp / META_FILE, lambda file: torch.save(_metadata(checkpoint), file))
            swap_into_place(tmp, target)
        except BaseException as error:  # every rank must hear of it: broadcast, then raised
            shutil.rmtree(tmp, ignore_errors=True)
            refusal = named(error, target, who="rank 0")
            if refusal is None and not distributed:
                raise
            why = f"rank 0 could not commit the sharded checkpoint {str(target)!r}: {error!r}"
            failure = (None, why) if refusal is None else (refusal.errno, str(refusal))
    if distributed:
        outcome = [failure]
        dist.broadcast_object_list(outcome, group=group, group_src=0)
        failure = outcome[0]
    if failure is not None:
        code, message = failure
        raise RuntimeError(message) if code is None else PipeckptSaveError(code, message)


# -- load ----------------------------------------------------------------------------------------


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written by :func:`save`."""
    root = Path(path)
    return root.is_dir() and (root / _DCP_METADATA).is_file() and (root / META_FILE).is_file()


def require_sharded(path: str | os.PathLike) -> Path:
    """``path``, refused naming what is missing unless it is a whole sharded checkpoint directory."""
    root = Path(path)
    missing = [name for name in (_DCP_METADATA, META_FILE) if not (root / name).is_file()]
    if root.is_dir() and missing and (len(missing) == 1 or any(root.glob("*.distcp"))):
        what = {_DCP_METADATA: "DCP's index of the shards", META_FILE: "rank 0's part: loops, callbacks, RNG"}
        raise checkpoint_error(
            f"sharded checkpoint directory {str(path)!r}",
            "has no "
            + " and no ".join(f"{name} ({what[name]})" for name in missing)
            + ", so it is incomplete (a copy that left hidden files behind, or a file removed since)",
            "copy the whole directory again (hidden files included, e.g. `cp -r` or `rsync -a`), "
            "or resume from another checkpoint",
        )
    if not is_sharded(path):
        raise config_error(
            f"checkpoint path {str(path)!r}",
            f"is not a sharded checkpoint directory (one holding {_DCP_METADATA} and {META_FILE})",
            "pass a directory written by pipeckpt's sharded save (torch.load reads single-file checkpoints)",
        )
    return Path(path)


def _set(tree: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    """Puts ``value`` at ``path`` (DCP's path of a flattened key) in nested dicts (str keys) and
    lists (int keys: DCP walks into lists that hold tensors), making the containers on the way."""
    node: Any = tree
    for key, after in itertools.pairwise(path):
        fresh: Any = [] if isinstance(after, int) else {}
        if isinstance(node, list):
            index = int(key)
            node.extend([None] * (index + 1 - len(node)))
            node[index] = fresh if node[index] is None else node[index]
            node = node[index]
        else:
            node = node.setdefault(key, fresh)
    if isinstance(node, list):
        node.extend([None] * (int(path[-1]) + 1 - len(node)))
        node[int(path[-1])] = value
    else:
        node[path[-1]] = value


def _wanted(path: Sequence[str | int], keys: Collection[str] | None) -> bool:
    """``path`` is (state_dict, key) or (optimizer_states, i, name, ...): is it asked for?"""
    return keys is None or path[1 if path[0] == _MODEL else 2] in keys


def load(
    path: str | os.PathLike,
    *,
    keys: Collection[str] | None = None,
    weights_only: bool | None = None,
    index: ShardedIndex | None = None,
) -> dict[str, Any]:
    """The Lightning checkpoint in the sharded directory ``path``, read by this process alone (no
    collective, a process group or none).

    ``state_dict`` holds ``keys`` (None: all), and each ``optimizer_states[i]["state"]`` the state of
    those of them that are parameters, keyed by name; only those tensors' bytes are read, onto the CPU.
    ``weights_only`` is passed to ``torch.load`` for rank 0's part, as Lightning does. ``index``:
    ``path``'s index as :func:`~pipeckpt.state.sharded_index.read_index` read it (then not read again).
    """
    root = require_sharded(path)
    index = index or read_index(root, weights_only=weights_only)
    metadata = index.metadata
    stored = metadata.state_dict_metadata
    paths: dict[str, tuple[str | int, ...]] = metadata.planner_data  # DCP's key -> our nested path
    if keys is not None:
        present = {path[1] for path in paths.values() if path[0] == _MODEL}
        missing = sorted(set(keys) - present)
        if missing:
            raise config_error(
                f"keys {missing[:5]}",
                f"are not in the sharded checkpoint {str(root)!r}",
                "ask for keys of the module's state_dict as the checkpoint was written",
            )
    wanted: dict[str, Any] = {_MODEL: {}, _OPTIM: {}}
    for key, nested in paths.items():
        if not _wanted(nested, keys):
            continue
        item = stored[key]
        if isinstance(item, TensorStorageMetadata):
            _set(wanted, nested, torch.empty(item.size, dtype=item.properties.dtype))
        else:
            assert isinstance(item, BytesStorageMetadata)
            _set(wanted, nested, None)  # DCP puts the unpickled object here
    _require_shards(root, metadata, {key for key, nested in paths.items() if _wanted(nested, keys)})
    if any(wanted.values()):
        _read(wanted, index)
    checkpoint = {key: value for key, value in index.rest.items() if key != _FORMAT_KEY}
    checkpoint[_MODEL] = wanted[_MODEL]
    if _OPTIM in checkpoint:  # the index's own dicts stay as read
        checkpoint[_OPTIM] = [
            {**optimizer, "state": wanted[_OPTIM].get(str(number), {})}
            for number, optimizer in enumerate(checkpoint[_OPTIM])
        ]
    return checkpoint


def _require_shards(root: Path, metadata: Any, keys: Collection[str]) -> None:
    """Refuses a directory whose shard files holding ``keys`` (DCP's) are missing or shorter
    than its index says."""
    for name, needed in sorted(dcp_file_extents(metadata, keys).items()):
        shard = root / name
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < needed:
            how = "is missing" if size is None else f"holds {size} bytes of the {needed} its index names"
            raise checkpoint_error(
                f"sharded checkpoint directory {str(root)!r}",
                f"its shard file {name!r} {how}, so the checkpoint is incomplete",
                "copy the whole directory again, or resume from another checkpoint",
            )


def _read(wanted: dict[str, Any], index: ShardedIndex) -> None:
    """Fills ``wanted`` from the shards, this process alone; byte items weights-only."""
    root = index.root
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST)
            dcp.load(
                wanted,
                storage_reader=safe_load.SafeReader(root, metadata=index.metadata),
                planner=safe_load.SafeLoadPlanner(),
                no_dist=True,
            )
    except dcp.CheckpointException as error:  # a BaseException: `except Exception` misses it
        for failure, _ in error.failures.values():
            if isinstance(failure, PipeckptCheckpointError):
                raise failure from None
        raise RuntimeError(f"the sharded checkpoint {str(root)!r} could not be read: {error}") from error


def to_torch_save(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Writes the sharded checkpoint at ``path`` as one ``torch.save`` file at ``out``: the checkpoint
    Lightning writes without pipeckpt (optimizer state keyed by position), whose ``state_dict`` loads
    ``strict=True`` into the unpipelined module. Holds the whole checkpoint in memory."""
    checkpoint = load(path, weights_only=True)
    for number, optimizer in enumerate(checkpoint.get(_OPTIM, [])):
        names = [name for group in optimizer["param_groups"] for name in group["params"]]
        checkpoint[_OPTIM][number] = optimizer_state_by_index(optimizer, names)
    atomic_write(out, lambda file: torch.save(checkpoint, file))
