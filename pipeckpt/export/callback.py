"""``HFExport``: the Hugging Face export written at the end of ``fit``, under either engine.

Why through a checkpoint: under the distributed engine no process holds the whole model, and the
sharded checkpoint is where every stage's tensors meet, under the unpipelined module's keys, at any
layout. So when training ends every rank saves the weights (``weights_only``: no optimizer state)
beside the export, global rank 0 exports them one shard at a time (:func:`pipeckpt.export.export_hf`)
and removes them, and every rank hears how it went (a failure is raised on each). What can be
checked before training is checked when ``fit`` starts (the prefix, the target directory and
whether it can be written), so that a typo costs seconds, not a whole run.
"""

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from pipeckpt._errors import config_error
from pipeckpt.export.hf import export_hf, peft_parts, resolve_dtype
from pipeckpt.export.origin import origin_of
from pipeckpt.export.target import check_target, probe_writable
from pipeckpt.state.directories import remove
from pipeckpt.state.files import hidden_sibling_prefix

__all__ = ["HFExport"]


class HFExport(Callback):
    """Writes the Hugging Face model at ``prefix`` of the LightningModule (``self.model`` ->
    ``"model."``) as ``dirpath`` when training ends: config.json, safetensors shards of at most
    ``max_shard_size`` and their index, or a PEFT model's adapters; ``dtype``: None keeps the
    pretrained directory's (the training dtype without one), 'checkpoint' keeps the training dtype,
    or 'float32' / 'bfloat16'. The config and class are the module's own; the tokenizer and
    generation files are those of the directory the model was loaded from, if any."""

    def __init__(
        self,
        dirpath: Union[str, "os.PathLike[str]"],
        *,
        prefix: str = "model.",
        dtype: Union[str, torch.dtype, None] = None,
        max_shard_size: Union[int, str] = "5GB",
    ) -> None:
        resolve_dtype(dtype)  # refused here, not after training
        self.dirpath = Path(dirpath)
        self.prefix = prefix
        self.dtype = dtype
        self.max_shard_size = max_shard_size

    def _export_options(self, pl_module: LightningModule) -> dict:
        path = self.prefix[:-1] if self.prefix.endswith(".") else self.prefix
        try:
            model: Any = pl_module.get_submodule(path)
        except AttributeError:
            raise config_error(
                f"HFExport(prefix={self.prefix!r})",
                f"{type(pl_module).__name__} has no submodule {path!r}",
                "pass the attribute path of the Hugging Face model with a trailing dot "
                "(self.model -> prefix='model.')",
            ) from None
        parts = peft_parts(model)
        if parts is not None:
            base = parts["base"]
            return dict(config=base.config, model_class=type(base), adapter_config=parts["adapter_config"])
        if getattr(model, "config", None) is None:
            raise config_error(
                f"HFExport(prefix={self.prefix!r})",
                f"the submodule {path!r} is a {type(model).__name__}, not a Hugging Face model",
                "name the transformers PreTrainedModel (or PEFT model) in your LightningModule",
            )
        return dict(config=model.config, model_class=type(model))

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Refuses a wrong prefix, a target the export may not replace and one that cannot be
        written, on every rank before the first step (each rank sees the same files)."""
        options = self._export_options(pl_module)
        setting = "HFExport dirpath"
        check_target(self.dirpath, origin=origin_of(options["config"]), setting=setting)
        probe_writable(self.dirpath, setting=setting)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        options = self._export_options(pl_module)
        # The same name on every rank: the save is a collective under the distributed engine.
        staging = self.dirpath.with_name(f"{hidden_sibling_prefix(self.dirpath.name)}weights.ckpt")
        try:
            trainer.save_checkpoint(staging, weights_only=True)
        except BaseException:
            if trainer.is_global_zero:
                remove(staging)  # a partial save: nothing of the export is left behind
            raise
        error: Optional[BaseException] = None
        if trainer.is_global_zero:
            try:
                export_hf(
                    staging,
                    self.dirpath,
                    prefix=self.prefix,
                    dtype=self.dtype,
                    max_shard_size=self.max_shard_size,
                    **options,
                )
            except Exception as raised:
                error = raised
            finally:
                remove(staging)
        why = trainer.strategy.broadcast(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if why is not None:
            raise RuntimeError(f"global rank 0 could not export {str(self.dirpath)!r}: {why}")
