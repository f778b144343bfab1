"""A run's checkpoint as a Hugging Face directory that ``from_pretrained`` loads, one shard at a time.

Why not ``save_pretrained``: it takes the whole state dict at once, and no process of a pipelined
run holds the whole model. The plan is the library's own, made on a model built on the meta device
(no memory): transformers' ``remove_tied_weights_from_state_dict`` drops the tied copies its loader
re-ties (GPT-2's ``lm_head.weight``), huggingface_hub's ``split_torch_state_dict_into_shards`` cuts
the rest into ``model-0000k-of-0000n.safetensors`` and names the index; then each shard's keys are
read from the checkpoint (:class:`~pipeckpt.export.source.CheckpointSource`) a few at a time, cast,
and written tensor by tensor (:mod:`pipeckpt.export.safetensors_writer`: ``save_file`` would hold the
whole shard). Why not DCP's ``HuggingFaceStorageWriter``: it writes what one ``dcp.save`` call holds,
i.e. the whole model in one process here. The directory is written beside ``out`` and renamed onto
it whole (:mod:`pipeckpt.state.directories`), after the checks that make that safe: ``out`` is not
the pretrained directory and holds only an earlier export (:mod:`~pipeckpt.export.target`), and the
config's model has the checkpoint's every key and shape (:mod:`~pipeckpt.export.matching`). What the
pretrained directory brings besides the weights (dtype, tokenizer) is :mod:`~pipeckpt.export.origin`'s.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type, Union

import torch
from torch import nn

from pipeckpt._errors import config_error
from pipeckpt.export.matching import check_matches
from pipeckpt.export.origin import as_config, copy_source_files, origin_of, recorded, source_dtype
from pipeckpt.export.safetensors_writer import write_file
from pipeckpt.export.source import CheckpointSource
from pipeckpt.export.target import check_target, refusal, write_record
from pipeckpt.state.directories import swap_into_place, temporary_beside
from pipeckpt.state.files import fsync_tree

__all__ = ["export_hf", "resolve_dtype"]

PathLike = Union[str, "os.PathLike[str]"]
WEIGHTS_INDEX = "model.safetensors.index.json"
#: The most bytes of one shard read from the checkpoint at once (a larger tensor is read alone): the
#: export holds this much, plus the tensor DCP's reader loads before copying it out, never a shard.
#: Smaller costs a ``sharded.load`` call per group (a DCP read plan; the index is read once).
READ_BYTES = 16 * 2**20
#: ``dtype`` choices besides a cast: the pretrained directory's dtype, or the checkpoint's as stored.
SOURCE, CHECKPOINT = "source", "checkpoint"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> Union[str, torch.dtype]:
    """``None`` or ``"source"``: :data:`SOURCE`; ``"checkpoint"``: :data:`CHECKPOINT`; else the cast
    to float32 or bfloat16 (a name or a dtype)."""
    if dtype is None or dtype == SOURCE:
        return SOURCE
    if dtype == CHECKPOINT:
        return CHECKPOINT
    found = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype))
    if found not in (torch.float32, torch.bfloat16):
        raise config_error(
            f"dtype={dtype!r}",
            "an export keeps the pretrained directory's dtype ('source', the default), keeps the "
            "checkpoint's ('checkpoint'), or casts to float32 or bfloat16",
            "pass dtype=None, 'checkpoint', 'float32' or 'bfloat16'",
        )
    assert isinstance(found, torch.dtype)
    return found


def _model_class(config: Any, model_class: Any) -> Type[nn.Module]:
    import transformers

    if model_class is None:
        names = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, names[0], None) if names else None
        if model_class is None:
            raise config_error(
                f"a {type(config).__name__} with architectures={names!r}",
                "the export needs the model class, and the config names none that transformers has",
                "pass model_class (e.g. transformers.LlamaForCausalLM, --model-class LlamaForCausalLM)",
            )
    elif isinstance(model_class, str):
        name = model_class.rsplit(".", 1)[-1]
        if not hasattr(transformers, name):
            raise config_error(
                f"model_class={model_class!r}",
                "is not a model class of transformers",
                "name one such as LlamaForCausalLM or GPT2LMHeadModel",
            )
        model_class = getattr(transformers, name)
    return model_class


def skeleton(config: Any, model_class: Type[nn.Module]) -> nn.Module:
    """The model built on the meta device: its keys, shapes and ties, and no memory."""
    with torch.device("meta"):
        return model_class(config)


def _groups(layout: Dict[str, torch.Tensor]) -> Iterator[List[str]]:
    """``layout``'s keys in order, cut into reads of at most :data:`READ_BYTES` (or one tensor)."""
    group: List[str] = []
    size = 0
    for key, meta in layout.items():
        nbytes = meta.numel() * meta.element_size()
        if group and size + nbytes > READ_BYTES:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    if group:
        yield group


def _tensors(
    source: CheckpointSource, prefix: str, layout: Dict[str, torch.Tensor]
) -> Iterator[Tuple[str, torch.Tensor]]:
    """``layout``'s tensors read from ``source`` a group at a time and cast, each let go once yielded."""
    for group in _groups(layout):
        read = source.read([prefix + key for key in group])
        for key in group:
            yield key, read.pop(prefix + key).to(layout[key].dtype)


def write_weights(
    source: CheckpointSource,
    tmp: Path,
    model: nn.Module,
    *,
    prefix: str,
    dtype: Optional[torch.dtype],
    max_shard_size: Union[int, str],
) -> torch.dtype:
    """The model's safetensors shards and index into ``tmp``, each shard's keys read a few at a
    time (:func:`_groups`) and written as read, floating tensors cast to ``dtype`` (None: as
    stored); returns the dtype written."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from pipeckpt._compat.transformers_private import drop_tied_copies

    planned = drop_tied_copies(model.state_dict(), model)
    for ignored in getattr(model, "_keys_to_ignore_on_save", None) or []:
        planned.pop(ignored, None)
    stored = {key: source.shapes[prefix + key] for key in planned}
    cast = {
        key: value.to(dtype) if dtype and value.is_floating_point() else value
        for key, value in stored.items()
    }
    split = split_torch_state_dict_into_shards(
        cast, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, keys in split.filename_to_tensors.items():
        layout = {key: cast[key] for key in keys}
        write_file(tmp / filename, layout, _tensors(source, prefix, layout), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (tmp / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return next(iter(cast.values())).dtype


def _config_files(tmp: Path, model: Any, dtype: torch.dtype) -> None:
    """config.json as ``save_pretrained`` writes it (the class and dtype named), and the
    generation config where the model has one (``model``: a transformers PreTrainedModel)."""
    config = model.config
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(tmp)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(tmp)


def _what(source: CheckpointSource, prefix: Optional[str], config: Any) -> Tuple[str, Any, str]:
    """``(prefix, config, how the user named the config)``: as given, else as the checkpoint
    records them (a run of the app's ``model=hf``, :func:`pipeckpt.export.origin.recorded`)."""
    if prefix is not None and config is not None:
        return (
            prefix,
            config,
            f"config={config if isinstance(config, (str, os.PathLike)) else type(config).__name__}",
        )
    found = recorded(source.hyper_parameters)
    if found is None:
        raise config_error(
            f"checkpoint {str(source.path)!r} with prefix={prefix!r}, config={config!r}",
            "the export needs the model's prefix and config, and only a run of the app's model=hf "
            "records them in its checkpoint",
            "pass prefix= (--prefix, e.g. 'model.') and config= (--config: the pretrained directory "
            "or the model's config)",
        )
    prefix = found[0] if prefix is None else prefix
    config = found[1] if config is None else config
    return (
        prefix,
        config,
        f"the checkpoint's recorded config ({config if isinstance(config, str) else 'model.config'})",
    )


def _write(
    source: CheckpointSource,
    tmp: Path,
    model: nn.Module,
    *,
    prefix: str,
    dtype: Union[str, torch.dtype],
    adapters: Optional[nn.Module],
    origin: Optional[Path],
    max_shard_size: Union[int, str],
) -> None:
    """The export into ``tmp``: weights and config, or the adapters of the PEFT model ``adapters``
    (as trained unless ``dtype`` casts), then the pretrained directory ``origin``'s tokenizer and
    generation files and the record of what was written."""
    cast = dtype if isinstance(dtype, torch.dtype) else None
    if adapters is not None:
        from pipeckpt.export.adapters import write_adapters

        write_adapters(source, tmp, adapters, prefix=prefix, dtype=cast)
    else:
        cast = source_dtype(origin) if dtype == SOURCE else cast
        written = write_weights(source, tmp, model, prefix=prefix, dtype=cast, max_shard_size=max_shard_size)
        _config_files(tmp, model, written)
    copy_source_files(origin, tmp)
    write_record(tmp)
    fsync_tree(tmp)  # the files as durable as the name the rename gives them


def export_hf(
    checkpoint: PathLike,
    out: PathLike,
    *,
    prefix: Optional[str] = None,
    config: Any = None,
    model_class: Any = None,
    adapter_config: Any = None,
    dtype: Union[str, torch.dtype, None] = None,
    max_shard_size: Union[int, str] = "5GB",
) -> Path:
    """Writes the model in the Lightning ``checkpoint`` (a sharded directory of the distributed
    engine, or a local engine's ``.ckpt``) as the directory ``out`` that ``from_pretrained`` loads:
    config.json, model-only safetensors shards of at most ``max_shard_size`` and their index, no
    optimizer state, and the tokenizer and generation files of the pretrained directory the model
    came from. ``prefix``: the Hugging Face model's attribute path in the LightningModule
    (``self.model`` -> ``"model."``); ``config``: its ``PretrainedConfig``, or a local directory or
    config.json; both default to what a run of the app's ``model=hf`` records in its checkpoint.
    ``model_class``: its transformers class (default: the config's ``architectures``). With
    ``adapter_config`` (a ``PeftConfig``, or a directory holding adapter_config.json) the module at
    ``prefix`` is a PEFT model and ``out`` holds its adapters, for ``PeftModel.from_pretrained``.
    ``dtype``: None keeps the pretrained directory's (the checkpoint's where there is none, and for
    adapters), 'checkpoint' the checkpoint's, or 'float32' / 'bfloat16'.

    Refused before anything is written: an ``out`` that is the pretrained directory or holds files
    no export wrote, and a config whose model differs from the checkpoint in any key or shape. A
    read-only or full filesystem is named (a ``PipeckptSaveError``) and the partial export removed.
    Reads and writes a few tensors at a time: from a sharded directory the export holds at most
    :data:`READ_BYTES` of them or its largest tensor, plus the stored tensor DCP's reader loads
    beside it; from a ``.ckpt``, the mapped file's pages; never a shard. Returns ``out``."""
    target = Path(out)
    chosen = resolve_dtype(dtype)
    source = CheckpointSource(checkpoint)
    prefix, config, named = _what(source, prefix, config)
    origin = origin_of(config)
    check_target(target, origin=origin)
    hf_config = as_config(config, "config")
    model = skeleton(hf_config, _model_class(hf_config, model_class))
    adapters = None
    if adapter_config is not None:
        from pipeckpt.export.adapters import peft_skeleton

        adapters = peft_skeleton(model, adapter_config)
    check_matches(source, prefix, (adapters or model).state_dict(), config=named)
    tmp: Optional[Path] = None
    try:
        tmp = Path(temporary_beside(target))
        tmp.mkdir()
        _write(
            source, tmp, model, prefix=prefix, dtype=chosen, adapters=adapters, origin=origin,
            max_shard_size=max_shard_size,
        )  # fmt: skip
        swap_into_place(tmp, target)
    except BaseException as error:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        named_error = refusal(target, error) if isinstance(error, Exception) else None
        if named_error is not None:
            raise named_error from error
        raise
    return target


def peft_parts(module: nn.Module) -> Optional[Dict[str, Any]]:
    """``{"base": the base model, "adapter_config": its PeftConfig}`` when ``module`` is a PEFT
    model with one adapter, else None."""
    configs = getattr(module, "peft_config", None)
    get_base = getattr(module, "get_base_model", None)
    if not isinstance(configs, dict) or get_base is None:
        return None
    if len(configs) != 1:
        raise config_error(
            f"a PEFT model with adapters {sorted(configs)}",
            "an export writes one adapter",
            "export from a model with one adapter (delete_adapter the others before training)",
        )
    return {"base": get_base(), "adapter_config": next(iter(configs.values()))}
