"""A pretrained model named as people name it: a local path, or a Hub id found in the local cache.

Why one place: the app's ``model.path``, :func:`pipeckpt.pretrained` and the export's recorded
directory all take a Hub id (``org/name``) as ``from_pretrained`` does, and each resolving it its own
way would let them disagree on which snapshot an id means. Resolved through ``huggingface_hub`` in its
local cache only (``HF_HUB_CACHE``; the ``main`` revision's snapshot), never downloaded: a run reads
what the user has, and the same id reads the same files on every process. What a snapshot's files may
link to is :mod:`pipeckpt.weights.confinement`'s rule.
"""

import re
from pathlib import Path
from typing import List, Union

__all__: List[str] = []

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def local_directory(value: Union[str, Path]) -> Path:
    """The path ``value`` names: itself when it exists, else the snapshot of the Hub id ``value``
    (``org/name``) in huggingface_hub's local cache, never downloaded; ``value`` as given when neither
    (its refusal says so: :func:`absent`)."""
    given = Path(value).expanduser()
    if given.exists() or not _HUB_ID.fullmatch(str(value)):
        return given
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return given
    try:
        return Path(snapshot_download(str(value), local_files_only=True))
    except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError), or not a Hub id
        return given


def cache_directory() -> str:
    """Where huggingface_hub's local cache is (``HF_HUB_CACHE``), to name in a refusal."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return "huggingface_hub is not installed"
    return str(constants.HF_HUB_CACHE)


def absent() -> str:
    """What a refusal says of a value that names nothing here: no such path, and no Hub id in the
    cache (where it is)."""
    return (
        f"no such file or directory, nor a Hub id in huggingface_hub's local cache ({cache_directory()}); "
        "nothing is downloaded"
    )
