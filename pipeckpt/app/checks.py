"""The app's settings checked as a whole, once the config is composed and before anything is built.

Why here and not in the objects the config builds: a model or a data module built from a bad value
fails deep inside (a ``ZeroDivisionError`` in the data's windows, Lightning's hparams merge) with the
constructor's names, not the setting the user typed; and it fails only after the heavy imports and
the corpus are loaded. Hydra's schema (:mod:`pipeckpt.app.config`) checks names and types; each
numeric field there carries its :class:`Range`, and :func:`check_config` walks them, then checks what
spans groups (the data against the model, the parallel sizes against the world the trainer asks for,
the schedule's name). Every refusal names the setting as typed on the command line (``data.seq_len=0``).
"""

import math
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from pipeckpt._errors import PipeckptConfigError, config_error
from pipeckpt.engines import engine_class
from pipeckpt.sizes import parse_bytes

__all__ = ["Range", "check_config", "check_overrides"]


@dataclass(frozen=True)
class Range:
    """The values a numeric setting takes: ``low`` to ``high``, each end included unless ``*_open``.
    ``or_fraction``: a float is a fraction in [0, 1] instead (Lightning's ``limit_*_batches``)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    or_fraction: bool = False

    def holds(self, value: Any) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return False
        if self.or_fraction and isinstance(value, float):
            return 0.0 <= value <= 1.0
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return low_ok and high_ok

    def text(self) -> str:
        """``>= 1``, ``in [0, 1)``: the range as a rule."""
        if self.low is not None and self.high is not None:
            ends = ("(" if self.low_open else "[", ")" if self.high_open else "]")
            span = f"in {ends[0]}{_num(self.low)}, {_num(self.high)}{ends[1]}"
        elif self.low is not None:
            span = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        else:
            span = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return f"{span}, or a fraction in [0.0, 1.0]" if self.or_fraction else span


def _num(x: Optional[float]) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def check_config(cfg: DictConfig) -> None:
    """Refuses the first setting of ``cfg`` out of its range or at odds with another setting."""
    _check_model_named(cfg)
    _check_followed_keys_exist(cfg)
    _check_ranges(cfg, "")
    _check_model(cfg)
    _check_data_follows_model(cfg)
    _check_budget(cfg)
    strategy = cfg.get("strategy")
    if isinstance(strategy, DictConfig) and "_target_" in strategy:
        _check_schedule(strategy.get("schedule"))
        _check_world(cfg)


def _check_ranges(node: DictConfig, prefix: str) -> None:
    schema = OmegaConf.get_type(node)
    ranges: Dict[str, Range] = {}
    if schema is not None and is_dataclass(schema):
        ranges = {f.name: f.metadata["range"] for f in fields(schema) if "range" in f.metadata}
    for key in map(str, node):
        name = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            continue
        if key in ranges:
            value, span = node[key], ranges[key]
            if value is not None and not span.holds(value):
                rule = span.text()
                raise config_error(f"{name}={value}", f"must be {rule}", f"set {name} to a value {rule}")
        elif not OmegaConf.is_interpolation(node, key) and isinstance(node[key], DictConfig):
            _check_ranges(node[key], f"{name}.")


def _check_model(cfg: DictConfig) -> None:
    """What the GPT's sizes need of each other; a Hugging Face model's directory or config, and the
    data's windows and token ids against it."""
    model = cfg.get("model")
    if isinstance(model, DictConfig) and str(model.get("_target_", "")).endswith(".HFCausalLM"):
        from pipeckpt.app.models.hf import check_tokens, checked_config  # transformers, only for model=hf
        from pipeckpt.app.models.hf_resume import check_resumed_path

        check_resumed_path(model.path, cfg.get("ckpt_path"))  # before the directory is read
        built = checked_config(model.path, model.config, model.seq_len)
        data = cfg.get("data")
        if isinstance(data, DictConfig) and "tokenizer" in data:
            check_tokens(built, model.path, data.tokenizer)
        return
    if not isinstance(model, DictConfig) or not str(model.get("_target_", "")).endswith(".GPT"):
        return
    from pipeckpt.app.models.gpt import SIZES  # only when the model is a GPT

    if model.size not in SIZES:
        raise config_error(
            f"model.size={model.size}", f"the GPT sizes are {sorted(SIZES)}", "set model.size to one of them"
        )
    size = SIZES[model.size]
    d_model = model.d_model if model.d_model is not None else size["d_model"]
    heads = model.n_heads if model.n_heads is not None else size["n_heads"]
    if d_model % heads:
        raise config_error(
            f"model.d_model={d_model} with model.n_heads={heads}",
            "each attention head takes d_model / n_heads features, so n_heads must divide d_model",
            f"set model.n_heads to a divisor of {d_model}, or model.d_model to a multiple of {heads}",
        )


def _equal(data: Any, model: Any) -> bool:
    return bool(data == model)


def _at_most(data: Any, model: Any) -> bool:
    return bool(data <= model)


# The keys a data option takes from the model (conf/data/*.yaml: ``${model.<key>}``), and how they
# must relate: the windows are the model's length (Lightning also merges both hparams and refuses two
# values), the shapes fit its layers, and tokens lie inside its vocabulary.
_FOLLOWS_MODEL: Dict[str, Callable[[Any, Any], bool]] = {
    "seq_len": _equal,
    "in_features": _equal,
    "in_channels": _equal,
    "num_classes": _equal,
    "vocab_size": _at_most,
}


def _check_model_named(cfg: DictConfig) -> None:
    """``model=custom`` and ``data=custom`` name their module by its import path (conf/model/custom.yaml
    and conf/data/custom.yaml leave it unset)."""
    named = (
        ("model", "a model", "LightningModule", "MyModule"),
        ("data", "data", "LightningDataModule", "MyData"),
    )
    for group, what, kind, example in named:
        node = cfg.get(group)
        if isinstance(node, DictConfig) and OmegaConf.is_missing(node, "_target_"):
            raise config_error(
                f"{group}=custom without {group}._target_",
                f"{what} of your own is named by its {kind}'s import path, its arguments by "
                f"+{group}.NAME=VALUE",
                f"add {group}._target_=my_package.{example} (importable from where you run the command)",
            )


def _check_followed_keys_exist(cfg: DictConfig) -> None:
    """A data setting that follows the model's (``data.seq_len: ${model.seq_len}``) under a model
    whose config has no such key (a model of your own, ``model=custom``): said in the user's names,
    before anything reads it (OmegaConf's own error is an InterpolationKeyError traceback)."""
    data, model = cfg.get("data"), cfg.get("model")
    if not isinstance(data, DictConfig) or not isinstance(model, DictConfig):
        return
    raw = OmegaConf.to_container(data, resolve=False)
    assert isinstance(raw, dict)
    for key, value in raw.items():
        key = str(key)
        followed = value[2:-1] if isinstance(value, str) and value.startswith("${model.") else None
        name = (followed or "")[len("model.") :].split(".")[0]
        if followed is not None and value.endswith("}") and name not in model:
            raise config_error(
                f"data.{key} (it follows {followed}) with model._target_={model.get('_target_')}",
                f"the model's config has no {name}: a model of your own "
                "(model=custom) takes only its own arguments",
                f"set data.{key}=VALUE on the command line",
            )


def _check_data_follows_model(cfg: DictConfig) -> None:
    data, model = cfg.get("data"), cfg.get("model")
    if not isinstance(data, DictConfig) or not isinstance(model, DictConfig):
        return
    for key, fits in _FOLLOWS_MODEL.items():
        if key in data and key in model and data[key] is not None and model[key] is not None:
            if not fits(data[key], model[key]):
                rule = "at most" if key == "vocab_size" else "equal to"
                raise config_error(
                    f"data.{key}={data[key]} with model.{key}={model[key]}",
                    f"the data's {key} must be {rule} the model's",
                    f"set model.{key}={data[key]} and drop the data.{key} override (the data follows "
                    f"model.{key} unless told otherwise)",
                )


def _check_budget(cfg: DictConfig) -> None:
    """``memory.budget`` is a string to the schema; unchecked here, a typo would surface from the
    strategy's settings under the Python argument's name, after the corpus is loaded."""
    memory = cfg.get("memory")
    if isinstance(memory, DictConfig) and memory.get("budget") is not None:
        parse_bytes(memory.budget, "memory.budget")


def _check_schedule(name: Any) -> None:
    """A schedule's name is checked under any engine: a typo is a typo, whatever runs it."""
    if name is None:
        return
    from pipeckpt.engines.distributed.schedules import lookup  # torch's pipelining, only when named

    try:
        lookup(name)
    except PipeckptConfigError as error:
        raise PipeckptConfigError(f"strategy.{error}") from None


def _world(trainer: Any) -> Optional[int]:
    """The processes the trainer asks for, when the config says (devices a count or a list)."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes")
    if not isinstance(nodes, int) or nodes < 1:
        return None
    if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        return devices * nodes
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        return len(devices) * nodes if len(devices) else None
    return None


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _check_world(cfg: DictConfig) -> None:
    """``pp x dp x tensor_parallel`` against the world, before the strategy asks for a plan."""
    s = cfg.strategy
    tp = _count(s.get("tensor_parallel"))
    world = _world(cfg.trainer)
    if tp is None or tp == 1 or world is None:
        return
    if "tensor_parallel" not in engine_class(s.get("engine", "local")).own_settings:
        return  # the engine refuses the setting itself
    on = (
        f"trainer.devices={cfg.trainer.devices} x trainer.num_nodes={cfg.trainer.num_nodes} = {world} "
        "processes"
    )
    rule = "pp x dp x tensor_parallel must equal the world size"
    if world % tp:
        raise config_error(
            f"strategy.tensor_parallel={tp} on {on}",
            f"{rule}, so tensor_parallel must divide it",
            f"set strategy.tensor_parallel to one of {_divisors(world)}, or run a multiple of {tp} "
            "processes (trainer.devices x trainer.num_nodes)",
        )
    dp = _count(s.get("dp"))
    if dp is not None and world % (dp * tp):
        raise config_error(
            f"strategy.dp={dp} with strategy.tensor_parallel={tp} on {on}",
            f"{rule}, so dp x tensor_parallel = {dp * tp} must divide it",
            f"set strategy.dp to one of {_divisors(world // tp)}, or run a multiple of {dp * tp} processes",
        )
    stages = len(s.balance) if s.get("balance") is not None else _count(s.get("stages"))
    v = _count(s.get("virtual_stages")) or 1
    if dp is None and stages is not None and stages % v == 0 and world % (stages // v * tp):
        pp = stages // v
        raise config_error(
            f"strategy.stages={stages} (pp={pp}) with strategy.tensor_parallel={tp} on {on}",
            f"{rule}, so pp x tensor_parallel = {pp * tp} must divide it",
            f"set strategy.stages so that stages / virtual_stages is one of {_divisors(world // tp)}, "
            f"or run a multiple of {pp * tp} processes",
        )


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_overrides(args: Sequence[str]) -> None:
    """Command-line overrides Hydra's grammar refuses because a value holds a character outside
    ASCII (a path ``données``): Hydra's lexer names the position, not that quoting fixes it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = None
    for arg in args:
        if arg.startswith("-") or "=" not in arg or arg.split("=", 1)[1].isascii():
            continue
        parser = parser or OverridesParser.create()
        try:
            parser.parse_overrides([arg])
        except OverrideParseException:
            key, value = arg.split("=", 1)
            odd = next(c for c in value if not c.isascii())
            raise config_error(
                arg,
                f"Hydra's override grammar takes characters outside ASCII ({odd!r}) only inside quotes",
                f"quote the value, and quote the quotes for the shell: \"{key}='{value}'\"",
            ) from None
