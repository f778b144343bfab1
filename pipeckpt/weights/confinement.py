"""A pretrained directory's files are read only from inside it, or from its Hub repository folder.

Why: a directory is something a user was handed (a download, a colleague's copy). Its index names
the shards by path, and any file in it may be a symbolic link: without a check, an entry
``../../elsewhere`` or a ``model.safetensors`` linked to another model's file fills the module with
weights from outside what the user pointed at. The one exception is Hugging Face's own cache: a
snapshot ``models--org--name/snapshots/<revision>/`` holds only relative links into
``models--org--name/blobs/``, so for a snapshot the boundary is the repository folder that holds
both. Every file read (config, tokenizer, index, shards, single weights file) is resolved here first,
links followed, and refused unless it lies inside; nothing is read from a refused directory.
"""

import os
from pathlib import Path
from typing import List, Union

from pipeckpt._errors import checkpoint_error
from pipeckpt.state.confined import escape

__all__: List[str] = []

#: The folders of huggingface_hub's cache that hold one repository each (``<kind>s--org--name``).
_REPOSITORIES = ("models--", "datasets--", "spaces--")
_HINT = (
    "a pretrained directory is read only from inside itself (or, for a Hub cache snapshot, its "
    "repository folder models--org--name): copy the directory with its links followed "
    "(`cp -rL`, `rsync -aL`) if you trust where they lead, or point at the directory itself"
)


def boundary(directory: Union[str, Path]) -> Path:
    """The folder every file of ``directory`` must lie in: the directory itself (links followed), or
    for a Hub snapshot (``<cache>/models--org--name/snapshots/<revision>``) its repository folder."""
    real = Path(os.path.realpath(directory))
    snapshots, repository = real.parent, real.parent.parent
    if snapshots.name == "snapshots" and repository.name.startswith(_REPOSITORIES):
        return repository
    return real


def within(directory: Union[str, Path], name: str, what: str) -> Path:
    """``directory / name``, refused unless it lies inside :func:`boundary` once links are followed;
    ``what`` says which entry names it (``"model.safetensors.index.json's weight_map"``)."""
    base = Path(directory)
    limit = boundary(base)
    how = escape(base, name, within=limit)
    if how is not None:
        where = (
            "" if limit == Path(os.path.realpath(base)) else f" (or its Hub repository folder {str(limit)!r})"
        )
        raise checkpoint_error(
            f"pretrained directory {str(base)!r}",
            f"{what} names the file {name!r}, which {how}{where}; nothing was read from it",
            _HINT,
        )
    return base / name
