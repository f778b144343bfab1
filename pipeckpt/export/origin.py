"""Where an export's model comes from: its config, and the pretrained directory the run started from.

Why: the weights alone are not what a user started with. A run fine-tuned from a Hugging Face
directory trains in float32 and saves no tokenizer, so an export of its checkpoint alone came back
float32 where the directory was bf16, and ``AutoTokenizer.from_pretrained`` failed on it. The
directory is found from the config: the one given as ``config``, or the one transformers read the
config from (``config._name_or_path``, which ``from_config`` keeps), when it is a local directory
holding config.json; after a run of the app's ``model=hf`` the checkpoint names it itself
(:func:`recorded`). From it the export takes its default dtype (:func:`source_dtype`) and its
tokenizer and generation files (:func:`copy_source_files`).

Configs are read with ``trust_remote_code=False`` and local files only: an export never runs code
from a directory, and never asks.
"""

import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

import torch

from pipeckpt._errors import config_error
from pipeckpt.weights.hub import local_directory

__all__ = ["as_config", "copy_source_files", "origin_of", "read_config", "recorded", "source_dtype"]

#: The files of a pretrained directory that an export of its weights takes along: the tokenizer's
#: (fast and slow, SentencePiece and BPE, the chat template) and the generation settings.
SOURCE_FILES = re.compile(
    r"tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json"
    r"|vocab\.(json|txt)|merges\.txt|spiece\.model|sentencepiece\.bpe\.model"
    r"|chat_template\.(json|jinja)|generation_config\.json"
)
#: The dtypes a config.json may name that an export keeps.
_KEPT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: The key under which the app's ``model=hf`` (pipeckpt/app/models/hf.py) records its directory.
_RECORD_KEY = "pretrained_path"
_RECORDED_PREFIX = "model."


def _one_line(text: str) -> str:
    return " ".join(text.split())


def read_config(path: "os.PathLike[str] | str", setting: str) -> Any:
    """The ``PretrainedConfig`` of the local directory (or config.json) ``path``, read without
    running any code of the directory; ``setting`` names where the user gave it (``config=``)."""
    import transformers

    where = Path(path)
    directory = where.parent if where.is_file() else where
    try:
        return transformers.AutoConfig.from_pretrained(
            os.fspath(directory), trust_remote_code=False, local_files_only=True
        )
    except (ValueError, OSError, KeyError) as error:
        fields = _fields(directory)
        if fields.get("auto_map"):
            rule = (
                f"its config.json has model_type {fields.get('model_type')!r} with code of its own "
                "(auto_map), and an export runs no code from a directory (trust_remote_code=False)"
            )
            fix = (
                "load that code yourself if you trust it, then call export_hf with config=<the "
                "model's config object> and model_class=<its class>"
            )
        else:
            rule = f"transformers cannot read a config from it ({_one_line(str(error))[:200]})"
            fix = "point it at the directory save_pretrained wrote for the model trained"
        raise config_error(f"{setting}={str(path)!r}", rule, fix) from None


def _fields(directory: Path) -> Mapping[str, Any]:
    """config.json's fields, or nothing where it is absent or not JSON (read as data, no code)."""
    try:
        fields = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return fields if isinstance(fields, dict) else {}


def origin_of(config: Any) -> Optional[Path]:
    """The local pretrained directory ``config`` came from: itself when it is a directory (or its
    config.json), else the directory transformers read it from; None when there is none."""
    if isinstance(config, (str, os.PathLike)):
        where = Path(config)
        where = where.parent if where.is_file() else where
    elif getattr(config, "_name_or_path", None):
        where = Path(config._name_or_path)
    else:
        return None
    return where.resolve() if (where / "config.json").is_file() else None


def as_config(config: Any, setting: str) -> Any:
    """A copy of the ``PretrainedConfig`` ``config`` (the export names its class and dtype in it),
    or the one read from a local directory or config.json."""
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        return read_config(config, setting)
    raise config_error(
        f"{setting}={config!r}",
        "the export's config is a transformers PretrainedConfig, or a local directory or config.json",
        "pass the run's model config (model.config) or the pretrained directory it started from",
    )


def recorded(hyper_parameters: Any) -> Optional[Tuple[str, Any]]:
    """``(prefix, config)`` of a checkpoint of the app's ``model=hf``, whose hyper-parameters name
    its pretrained directory (``pretrained_path``): the model at ``model.``, whose config is that
    directory's, or, trained from scratch, the one its ``model.config`` built (naming the class
    ``AutoModelForCausalLM`` built from it). None for any other checkpoint."""
    if not isinstance(hyper_parameters, Mapping) or _RECORD_KEY not in hyper_parameters:
        return None
    path = hyper_parameters[_RECORD_KEY]
    if path is not None:
        directory = _local(str(path))
        if directory is None:
            raise config_error(
                f"the checkpoint's model.path={path}",
                "the export reads the run's config from the pretrained directory it started from, "
                "and no local directory (nor Hub id in huggingface_hub's local cache) by that name "
                "holds a config.json here",
                "pass --config (config=) naming that directory where it is now",
            )
        return _RECORDED_PREFIX, str(directory)
    import transformers

    from pipeckpt.app.models.hf import hf_config

    config = hf_config(None, hyper_parameters.get("config"))
    if not getattr(config, "architectures", None):  # the class the app built: AutoModelForCausalLM's
        built: Any = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        config.architectures = [built.__name__]
    return _RECORDED_PREFIX, config


def _local(path: str) -> Optional[Path]:
    """The directory holding config.json that ``path`` names: itself, or the snapshot of a Hub id
    in huggingface_hub's local cache (never downloaded: :mod:`pipeckpt.weights.hub`); None where
    there is none."""
    found = local_directory(path)
    return found if (found / "config.json").is_file() else None


def source_dtype(origin: Optional[Path]) -> Optional[torch.dtype]:
    """The dtype the pretrained directory ``origin``'s config.json names (float32, float16 or
    bfloat16), or None where there is no directory or it names none of them."""
    if origin is None:
        return None
    fields = _fields(origin)
    return _KEPT.get(str(fields.get("dtype") or fields.get("torch_dtype")))


def copy_source_files(origin: Optional[Path], tmp: Path) -> None:
    """Copies ``origin``'s tokenizer and generation files (:data:`SOURCE_FILES`) into ``tmp``; the
    directory's generation settings replace the model class's defaults."""
    if origin is None:
        return
    for path in sorted(origin.iterdir()):
        if path.is_file() and SOURCE_FILES.fullmatch(path.name):
            shutil.copyfile(path, tmp / path.name)
