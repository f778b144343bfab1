"""``model.path`` as people have it: a local directory or a Hub id in the local cache, its files
checked before transformers reads any of them.

Why: transformers reads a directory's config.json and tokenizer with its own errors (a raw
``JSONDecodeError`` without the file's name, ``UnicodeDecodeError``, a traceback from the
tokenizers library), imports the Python files a config's ``auto_map`` names when allowed to (and
asks on a terminal when not told), and follows any symbolic link. Here every file it will read is
confined to the directory (or its Hub repository folder: :mod:`pipeckpt.weights.confinement`), every
JSON one parsed, and code refused unless ``model.trust_remote_code`` is set, each refusal naming the
file; a Hub id is looked up in huggingface_hub's local cache only, never downloaded
(:mod:`pipeckpt.weights.hub`, shared with :func:`pipeckpt.pretrained`).
"""

import json
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch

from pipeckpt._errors import config_error
from pipeckpt.app.data.hf_text import has_tokenizer, token_range
from pipeckpt.weights.confinement import within
from pipeckpt.weights.hub import local_directory
from pipeckpt.weights.listing import list_checkpoint
from pipeckpt.weights.matching import check

__all__ = [
    "local_directory",
    "checked_files",
    "read_json",
    "needs_code",
    "refuse_code",
    "check_weights",
    "checked_token_range",
]

#: The files transformers may read for a config, a generation config and a tokenizer.
_CONFIG = ("config.json", "generation_config.json")
_TOKENIZER = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
_REWRITE = "write the directory again with save_pretrained, or restore the file from where it came"


def checked_files(directory: Path, setting: str, names: Tuple[str, ...] = _CONFIG + _TOKENIZER) -> None:
    """Every file of ``names`` in ``directory`` confined to it, and the JSON ones parsed: each
    refusal names ``setting``'s file and what is wrong with it."""
    for name in names:
        if not (directory / name).exists() and not (directory / name).is_symlink():
            continue
        file = within(directory, name, f"{setting}'s {name}")
        if name.endswith(".json"):
            read_json(file, setting)


def read_json(file: Path, setting: str) -> Any:
    """``file``'s JSON, refused by name when it is not UTF-8 text or not JSON."""
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise config_error(
            f"{setting}'s {file.name} ({str(file)!r})", f"it is not UTF-8 text (byte {error.start})", _REWRITE
        ) from None
    except json.JSONDecodeError as error:
        raise config_error(
            f"{setting}'s {file.name} ({str(file)!r})",
            f"it is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})",
            _REWRITE,
        ) from None


def needs_code(directory: Path) -> Optional[str]:
    """What in ``directory``'s config.json needs the directory's own Python code: its ``auto_map``
    when its ``model_type`` is not one transformers has; None when transformers' own classes do."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = read_json(directory / "config.json", "model.path")
    if not isinstance(fields, dict) or "auto_map" not in fields:
        return None
    kind = fields.get("model_type")
    if isinstance(kind, str) and kind in CONFIG_MAPPING:
        return None
    named = _named(fields["auto_map"])
    return f"config.json's auto_map ({named}) for model_type {kind!r}, which transformers lacks"


def refuse_code(value: str, directory: Path, needs: str) -> Exception:
    """The refusal of a directory whose model needs its own code while ``model.trust_remote_code``
    is false."""
    return config_error(
        f"model.path={value}: {needs}",
        "pipeckpt runs no code from a model directory unless asked (nothing was imported from it)",
        f"set model.trust_remote_code=true if you trust the Python files in {str(directory)!r}",
    )


def tokenizer_code(directory: Path) -> Optional[str]:
    """What in ``directory``'s tokenizer_config.json needs the directory's own code: its ``auto_map``
    when its ``tokenizer_class`` is not one transformers has; None otherwise."""
    import transformers

    file = directory / "tokenizer_config.json"
    fields = read_json(file, "data.tokenizer") if file.is_file() else None
    if not isinstance(fields, dict) or "auto_map" not in fields:
        return None
    kind = str(fields.get("tokenizer_class") or "")
    if kind and hasattr(transformers, kind):
        return None
    return f"tokenizer_config.json's auto_map ({_named(fields['auto_map'])}) for tokenizer_class {kind!r}"


def _named(auto_map: Any) -> str:
    found: List[str] = []
    for entry in auto_map.values() if isinstance(auto_map, dict) else []:
        found += [e for e in (entry if isinstance(entry, list) else [entry]) if isinstance(e, str)]
    return ", ".join(found[:3]) or repr(auto_map)


def check_weights(
    path: str, built: Any, trust_remote_code: bool, ignore_keys: Optional[Sequence[str]]
) -> None:
    """The model ``built`` makes, on the meta device, against ``path``'s weights (keys no tensor takes
    only when ``ignore_keys`` is known: :func:`pipeckpt.weights.matching.check`)."""
    import transformers

    directory = local_directory(path)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(built, trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise config_error(
            f"model.path={path} (model_type {built.model_type!r})",
            f"model=hf trains a causal LM, and transformers has none for this config ({error})",
            "point model.path at a causal LM's directory (AutoModelForCausalLM loads it)",
        ) from None
    check(
        model,
        list_checkpoint(directory),
        directory,
        missing="error",
        ignore=ignore_keys,
        hint=f"the weights in model.path={path} and its config.json disagree: write the directory again "
        "with save_pretrained, or set config.json's sizes (num_hidden_layers, ...) to the weights', or "
        "name keys to leave unread in model.ignore_keys=[<regex>,...]",
    )


def checked_token_range(tokenizer: Optional[str]) -> int:
    """:func:`token_range`, after the tokenizer's files are checked; its loader's errors named."""
    if tokenizer is None or not has_tokenizer(tokenizer):
        return token_range(None)
    directory = Path(tokenizer)
    checked_files(directory, "data.tokenizer", _TOKENIZER)
    code = tokenizer_code(directory)
    if code is not None:
        raise config_error(
            f"data.tokenizer={tokenizer}: {code}",
            "the app's data reads a tokenizer with transformers' own classes, never a directory's code",
            "set data.tokenizer=null to read the text as bytes, or save a tokenizer transformers has "
            "in the directory",
        )
    try:
        return token_range(tokenizer)
    except Exception as error:  # the tokenizers library's own errors have no common type
        raise config_error(
            f"data.tokenizer={tokenizer}",
            f"transformers loads no tokenizer from it ({type(error).__name__}: {str(error)[:200]})",
            "write the tokenizer again with save_pretrained, or set data.tokenizer=null to read the text "
            "as bytes",
        ) from None
