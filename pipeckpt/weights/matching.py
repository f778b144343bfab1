"""A module against its checkpoint's listing, on keys and shapes alone, before any tensor is read.

Why: a module built from a config.json that disagrees with the shards (2 layers where the shards
hold 4, another vocabulary) would otherwise be found out one key at a time where each process
reads, or not at all: a layer the module lacks is simply never read. ``from_pretrained`` reports such
keys as "unexpected"; here they are refused, like missing keys and other shapes, on every process
alike when :func:`pipeckpt.pretrained` marks the module, naming the counts of each list of layers
that differ, unless the user names the keys to leave (``ignore``).
"""

import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set

from torch import Tensor, nn

from pipeckpt._errors import config_error
from pipeckpt.weights.adapters import adapter_ids, unwrapped_name
from pipeckpt.weights.listing import Listing

__all__: List[str] = []

_REBUILD = "build the module from the checkpoint's own config (AutoConfig.from_pretrained(path))"


def candidates(model: nn.Module, name: str) -> List[str]:
    """``name``'s keys in a checkpoint: itself, and without or with HF's ``base_model_prefix``; then
    the same of the name without PEFT's wrappers (:mod:`pipeckpt.weights.adapters`)."""
    unwrapped = unwrapped_name(model, name)
    return _prefixed(model, name) + (_prefixed(model, unwrapped) if unwrapped is not None else [])


def _prefixed(model: nn.Module, name: str) -> List[str]:
    prefix = getattr(model, "base_model_prefix", "")
    if not isinstance(prefix, str) or not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1 :]]
    return [name, f"{prefix}.{name}"]


def tensor_names(model: nn.Module) -> Dict[int, List[str]]:
    """Each tensor of ``model`` (by id) -> all its names (a tied tensor has several)."""
    names: Dict[int, List[str]] = {}
    for name, t in (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ):
        names.setdefault(id(t), []).append(name)
    return names


def check(
    model: nn.Module,
    listing: Listing,
    path: Path,
    *,
    missing: str,
    ignore: Optional[Sequence[str]],
    hint: Optional[str] = None,
) -> None:
    """Refuses ``model`` against ``listing`` (of the checkpoint at ``path``): a key of another
    shape, a saved tensor the checkpoint lacks (under ``missing="error"``), or a key nothing in the
    module takes, unless a pattern of ``ignore`` (or the model's own
    ``_keys_to_ignore_on_load_unexpected``) matches it (``re.search``); ``ignore=None`` leaves the
    keys no tensor takes to a later check that knows the user's patterns. ``hint``, when given,
    replaces the refusals' hints (the app's user sets no Python argument)."""
    saved = {id(t) for t in model.state_dict(keep_vars=True).values()}
    tensors: Dict[int, Tensor] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    used: Set[str] = set()
    lacking: List[str] = []
    adapters = adapter_ids(model)
    for i, names in tensor_names(model).items():
        if i in adapters:
            continue
        keys = [k for n in names for k in candidates(model, n) if k in listing.where]
        used.update(keys)
        if not keys:
            lacking += names[:1] if i in saved else []
            continue
        shape, want = listing.shapes[keys[0]], tuple(tensors[i].shape)
        if shape != want:
            raise config_error(
                f"{keys[0]} in {str(listing.where[keys[0]])!r} has shape {shape}, the module's {want}",
                "a pretrained checkpoint fills a module of the same configuration",
                hint or _REBUILD,
            )
    if lacking and missing == "error":
        raise config_error(
            f"{str(path)!r} lacks {_shown(sorted(lacking))} of {type(model).__name__}"
            f"{_counts(model, listing)}",
            "a module filled from a pretrained checkpoint finds every parameter and saved buffer "
            "there (buffers it does not save, such as rotary frequencies, come from its own code)",
            hint
            or f"{_REBUILD}, or pretrained(..., missing='init') to initialise the missing ones as a build "
            "from scratch does",
        )
    left = _left_over(model, listing, used, ignore) if ignore is not None else []
    if left:
        raise config_error(
            f"{str(path)!r} holds {len(left)} key(s) no tensor of {type(model).__name__} takes: "
            f"{_shown(left)}{_counts(model, listing)}",
            "every key of a pretrained checkpoint fills a tensor of the module (from_pretrained's "
            "'unexpected keys'), so a checkpoint of another configuration is not taken for this one",
            hint
            or f"{_REBUILD}, or pretrained(..., ignore=[<regex>, ...]) to leave the keys it matches unread",
        )


def _left_over(model: nn.Module, listing: Listing, used: Set[str], ignore: Iterable[str]) -> List[str]:
    """The checkpoint's keys no tensor takes and no pattern ignores; a base model read from a
    checkpoint of the model around it (its keys under ``base_model_prefix``) leaves the head's keys."""
    patterns = [*ignore, *(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    prefix = getattr(model, "base_model_prefix", "")
    around = isinstance(prefix, str) and prefix != "" and not hasattr(model, prefix)
    around = around and any(k.startswith(prefix + ".") for k in used)
    return sorted(
        k
        for k in listing.where
        if k not in used
        and not any(re.search(p, k) for p in patterns)
        and not (around and not k.startswith(prefix + "."))
    )


def _counts(model: nn.Module, listing: Listing) -> str:
    """``"; the checkpoint holds 4 of model.layers, the module 2"`` for each list of layers whose
    length differs from the checkpoint's count of its entries."""
    said = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or not len(m):
            continue
        held = _entries(listing.where, candidates(model, name))
        if held is not None and held != len(m):
            said.append(f"the checkpoint holds {held} of {name}, the module {len(m)}")
    return "; " + "; ".join(said[:2]) if said else ""


def _entries(keys: Iterable[str], spellings: List[str]) -> Optional[int]:
    """How many numbered entries (``<spelling>.<i>.``) ``keys`` hold under the spelling that holds
    most; None when none does."""
    best = 0
    for spelling in spellings:
        pattern = re.compile(re.escape(spelling) + r"\.(\d+)\.")
        best = max(best, len({m.group(1) for k in keys if (m := pattern.match(k))}))
    return best or None


def _shown(keys: List[str]) -> str:
    return ", ".join(keys[:4]) + (f", ... ({len(keys)} in all)" if len(keys) > 4 else "")
