"""Any Hugging Face causal LM, fine-tuned from a local pretrained directory or trained from a config.

The recipe of docs/FINE_TUNING.md as the app's ``model=hf``: ``configure_model`` builds the model from
its config (on the meta device under the ``pipe`` strategy: nothing allocated), marks it
:func:`pipeckpt.pretrained` when a directory is given, so that each process reads only its own
stages' tensors; ``configure_pipeline`` returns :func:`pipeckpt.pipeline_of` over the model's list of
decoder layers, found by its size (the ``ModuleList`` holding the most parameters), so any
architecture ``AutoModelForCausalLM`` builds works without a table of layer paths.
"""

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Optional, Sequence

import lightning as L
import torch
from omegaconf import OmegaConf
from torch import Tensor, nn

import pipeckpt
from pipeckpt._errors import config_error
from pipeckpt.app.data.hf_text import has_tokenizer
from pipeckpt.app.models.hf_directory import (
    check_weights,
    checked_files,
    checked_token_range,
    local_directory,
    needs_code,
    read_json,
    refuse_code,
)
from pipeckpt.app.models.hf_resume import PATH_HPARAM

__all__ = ["HFCausalLM", "hf_config", "checked_config", "check_tokens", "decoder_layers"]

#: None, a local config.json (or its directory), or config.json's fields as a mapping (Hydra's too).
ConfigSource = Any


def _config_file(value: str, setting: str, where: Optional[Path] = None) -> Path:
    """The config.json of a local directory (or the file itself; ``where``, the directory a Hub id
    names), refused by name when absent."""
    where = where or Path(value).expanduser()
    file = where / "config.json" if where.is_dir() else where
    if not file.is_file():
        found = "a directory without a config.json" if where.is_dir() else "no such file or directory"
        raise config_error(
            f"{setting}={value}",
            f"a local Hugging Face directory holds a config.json (save_pretrained writes one): this is "
            f"{found}",
            f"point {setting} at the directory save_pretrained wrote (python -m pipeckpt.app.tiny_pretrained "
            "DIR makes a tiny one), or at a Hub id in huggingface_hub's local cache; nothing is downloaded",
        )
    return file


def hf_config(
    path: Optional[str] = None, config: ConfigSource = None, *, trust_remote_code: Optional[bool] = None
) -> Any:
    """The ``PretrainedConfig`` to build: the directory ``path``'s (or a Hub id's in the local cache),
    or ``config``'s (a dict of config.json's fields with its ``model_type``, or a local config.json or
    a directory holding one), or with neither the tiny Llama of :mod:`pipeckpt.app.tiny_pretrained`.
    Reads local files only, each checked first (:mod:`pipeckpt.app.models.hf_directory`).

    ``trust_remote_code``: True runs a directory's own code where its config needs it, False refuses
    such a directory; None (a check made without the setting: the app's first checks) runs none and
    refuses none, returning config.json's fields for the checks they allow.
    """
    import transformers

    from pipeckpt.app.tiny_pretrained import tiny_config

    if path is not None and config is not None:
        raise config_error(
            f"model.path={path} with model.config={config}",
            "a pretrained directory brings its own config",
            "set model.path to fine-tune the directory, or model.config to train from scratch, not both",
        )
    if path is not None:
        directory = _config_file(path, "model.path", local_directory(path)).parent
        checked_files(directory, "model.path")
        needs = needs_code(directory)
        if needs is not None and not trust_remote_code:
            if trust_remote_code is None:
                return SimpleNamespace(**read_json(directory / "config.json", "model.path"))
            raise refuse_code(path, directory, needs)
        try:
            return transformers.AutoConfig.from_pretrained(
                directory, local_files_only=True, trust_remote_code=bool(trust_remote_code)
            )
        except (ValueError, OSError, KeyError, TypeError) as error:
            raise config_error(
                f"model.path={path}'s config.json ({str(directory / 'config.json')!r})",
                f"transformers builds no config from it ({error})",
                "write the directory again with save_pretrained, or fix config.json's model_type",
            ) from None
    if OmegaConf.is_config(config):  # the app's model.config, as Hydra hands it over
        config = OmegaConf.to_container(config)
    if isinstance(config, str):
        fields = read_json(_config_file(config, "model.config"), "model.config")
    elif config is None:
        return tiny_config("llama")
    else:
        fields = dict(config)
    kind = fields.pop("model_type", None)
    try:
        return transformers.AutoConfig.for_model(kind, **fields)
    except (ValueError, TypeError) as error:
        raise config_error(
            f"model.config={config} (model_type {kind!r})",
            f"a config names a model_type transformers knows ({error})",
            "give model_type (llama, qwen2, gpt2, ...) and that model's config fields",
        ) from None


def checked_config(
    path: Optional[str],
    config: ConfigSource,
    seq_len: int,
    *,
    trust_remote_code: Optional[bool] = None,
    ignore_keys: Optional[Sequence[str]] = None,
) -> Any:
    """:func:`hf_config`'s config, refused when the data's windows (``seq_len`` tokens) are longer
    than the model takes, or when ``path``'s weights do not fit the model its config.json builds
    (keys and shapes, from the index and the safetensors headers alone; keys the model does not take,
    unless ``ignore_keys`` matches them: None, as in the app's first checks, leaves those to the
    model's own check, which knows ``model.ignore_keys``)."""
    built = hf_config(path, config, trust_remote_code=trust_remote_code)
    if not isinstance(built, SimpleNamespace):
        _check_causal(built, path)
    positions = getattr(built, "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len > positions:
        raise config_error(
            f"model.seq_len={seq_len}",
            f"the model takes sequences of at most {positions} tokens (max_position_embeddings)",
            f"set model.seq_len <= {positions}",
        )
    if path is not None and not isinstance(built, SimpleNamespace):
        check_weights(path, built, bool(trust_remote_code), ignore_keys)
    return built


def _check_causal(built: Any, path: Optional[str]) -> None:
    """Refuses a config that ``AutoModelForCausalLM`` builds no model from (T5, DistilBERT, ViT, ...),
    before any work: transformers' own error lists every family it knows, after the run has begun."""
    import transformers

    auto_map = getattr(built, "auto_map", None) or {}
    if type(built) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING or "AutoModelForCausalLM" in auto_map:
        return
    kind = getattr(built, "model_type", type(built).__name__)
    setting = f"model.path={path}" if path is not None else "model.config"
    raise config_error(
        f"{setting} (model_type {kind!r})",
        f"model=hf trains a causal language model (what AutoModelForCausalLM builds), and {kind!r} "
        "is not one: an encoder-decoder (T5, ...) or an encoder alone has no next-token loss here",
        "choose a decoder family (llama, gpt2, qwen2, mistral, mixtral, ...), or pipeline this model in "
        "a script of your own with pipeckpt.pipeline_of (docs/REAL_MODELS.md)",
    )


def check_tokens(built: Any, path: Optional[str], tokenizer: Optional[str]) -> None:
    """Refuses data whose token ids (``tokenizer``'s, or bytes without one) lie outside the vocabulary
    of the model ``built`` (from ``path``, or from a config); a tokenizer whose files are damaged, lie
    outside its directory or need its own code is refused by name first."""
    ids = checked_token_range(tokenizer)
    vocab = getattr(built, "vocab_size", None)  # config.json's fields alone may lack it
    if not isinstance(vocab, int) or ids <= vocab:
        return
    source = (
        f"the tokenizer of {tokenizer}" if has_tokenizer(tokenizer) else "the text's bytes (no tokenizer)"
    )
    model = f"model.path={path}" if path is not None else "model.config"
    raise config_error(
        f"{model} (vocab_size {built.vocab_size}) with {source}: {ids} token ids",
        "the data's token ids must lie inside the model's vocabulary",
        "save the model's tokenizer in its directory (its ids fit), or use a model whose vocab_size "
        f"is at least {ids}",
    )


def decoder_layers(model: nn.Module) -> str:
    """The name of ``model``'s list of decoder layers: the ``ModuleList`` holding the most parameters
    (``model.layers`` in Llama, ``transformer.h`` in GPT-2; an MoE layer's list of experts sits inside
    one layer, so holds fewer)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise config_error(
            f"{type(model).__name__} has no ModuleList of layers",
            "the pipeline cuts a model's list of decoder layers into stages",
            "name the list with model.layers=<path> (as in model.named_modules())",
        )
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))[0]


class HFCausalLM(L.LightningModule):
    """A Hugging Face causal LM trained with its own loss (``self.model(**batch).loss``).

    Args:
        path: a local pretrained directory (config.json, safetensors weights, maybe a tokenizer), or
            a Hub id (``org/name``) in huggingface_hub's local cache: the model starts from its
            weights, converted to the training dtype.
        config: without ``path``, what to build from scratch (:func:`hf_config`).
        layers: the list of decoder layers to pipeline; None finds it (:func:`decoder_layers`).
        seq_len: the data's window length, at most the model's positions.
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
        trust_remote_code: run the Python code a directory's config.json names (``auto_map``) to
            build its model; False refuses such a directory, naming this setting.
        ignore_keys: regular expressions of the directory's keys to leave unread; any other key the
            model does not take is refused (``from_pretrained``'s "unexpected keys").
    """

    def __init__(
        self,
        *,
        path: Optional[str] = None,
        config: ConfigSource = None,
        layers: Optional[str] = None,
        seq_len: int = 128,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        trust_remote_code: bool = False,
        ignore_keys: Sequence[str] = (),
    ) -> None:
        super().__init__()
        # ``path`` is the data's corpus to Lightning, which refuses two values of one hparam.
        self.save_hyperparameters(ignore=["path"])
        self.hparams[PATH_HPARAM] = path
        self.path, self.layers, self.lr, self.weight_decay = path, layers, lr, weight_decay
        self.trust_remote_code, self.ignore_keys = trust_remote_code, [str(k) for k in ignore_keys]
        self.hparams["ignore_keys"] = self.ignore_keys  # plain strings: Hydra's list is no checkpoint data
        self.hf_config = checked_config(  # a bad directory: refused before any work
            path, config, seq_len, trust_remote_code=trust_remote_code, ignore_keys=self.ignore_keys
        )
        self.directory = local_directory(path) if path is not None else None
        self.model: Optional[nn.Module] = None
        self.flops_per_token: Optional[int] = None  # the whole model's, once built (app/throughput.py)

    def configure_model(self) -> None:
        """Under the ``pipe`` strategy this runs on the meta device: the model is built empty and
        made real where it trains, from the directory's files. Lightning may call it again."""
        if self.model is not None:
            return
        import transformers

        dtype = torch.get_default_dtype()  # float32, or what the precision sets (bf16-true)
        trust = self.trust_remote_code
        if self.directory is not None and not torch.empty(0).is_meta:  # no meta build (strategy=single)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                self.directory, dtype=dtype, local_files_only=True, trust_remote_code=trust
            ).train()
        else:
            model = transformers.AutoModelForCausalLM.from_config(
                self.hf_config, dtype=dtype, trust_remote_code=trust
            )
            if self.directory is not None:
                model = pipeckpt.pretrained(model, self.directory, ignore=self.ignore_keys)
        # 6 x the non-embedding parameters as transformers counts them (a token's forward and backward),
        # of the whole model before any stage is cut; for the MFU (app/throughput.py)
        self.flops_per_token = 6 * int(model.num_parameters(exclude_embeddings=True))
        self.model = model

    def configure_pipeline(self) -> nn.Module:
        assert self.model is not None, "configure_model runs first"
        return pipeckpt.pipeline_of(self.model, self.layers or decoder_layers(self.model))

    def forward(self, **batch: Tensor) -> Any:
        assert self.model is not None, "configure_model runs first"
        return self.model(**batch)

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(**batch).loss, prog_bar=True)

    def configure_optimizers(self) -> Any:
        trained = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trained, lr=self.lr, weight_decay=self.weight_decay)
