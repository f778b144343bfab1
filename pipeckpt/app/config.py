"""The schema of the app's Hydra configs (``conf/``), as dataclasses.

Why not YAML alone: it accepts any key and value, so ``chunk: 4`` or ``max_steps: ten`` would surface
late or never; registered in Hydra's ConfigStore, these dataclasses make them fail when the config is
composed. Hydra checks names and types; each numeric field also carries its range, checked with the
rules across groups by :func:`pipeckpt.app.checks.check_config` before anything is built. The
app's defaults live in the YAML files (fields here are ``MISSING``), except the strategy's settings
(``strategy``, ``ckpt``, ``memory``), generated from :class:`pipeckpt.settings.PipeSettings`
(with its defaults).
"""

from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from pipeckpt.app.checks import Range
from pipeckpt.settings import PipeSettings

__all__ = ["TrainConfig", "register"]


def _in(span: Range, default: Any = MISSING) -> Any:
    """A numeric field whose values lie in ``span``: :func:`pipeckpt.app.checks.check_config` refuses
    any other, naming the setting (a type is Hydra's to check, a value is not)."""
    return field(default=default, metadata={"range": span})


_COUNT = Range(low=1)
_AT_LEAST_0 = Range(low=0)
_AT_LEAST_MINUS_1 = Range(low=-1)  # Lightning's -1: no limit (max_steps, max_epochs), all (sanity steps)
_RATE = Range(low=0, low_open=True)
_DROPOUT = Range(low=0, high=1, high_open=True)
_FRACTION = Range(low=0, high=1, low_open=True, high_open=True)
_STEPS_OR_FRACTION = Range(low=1, or_fraction=True)
_BATCHES_OR_FRACTION = Range(low=0, or_fraction=True)
_SEED = Range(low=0, high=2**32 - 1)  # what Lightning's seed_everything (numpy's seed) takes


# -- model/ ---------------------------------------------------------------------------


@dataclass
class GPTConfig:
    _target_: str = "pipeckpt.app.models.GPT"
    size: str = MISSING  # a key of pipeckpt.app.models.SIZES: tiny, mini, small
    vocab_size: int = _in(_COUNT)
    seq_len: int = _in(_COUNT)  # also the data's window length
    dropout: float = _in(_DROPOUT)
    lr: float = _in(_RATE)  # peak learning rate, after warm-up
    weight_decay: float = _in(_AT_LEAST_0)
    warmup_steps: int = _in(_AT_LEAST_0)
    d_model: Optional[int] = _in(_COUNT, None)  # None: the size's value
    n_heads: Optional[int] = _in(_COUNT, None)
    n_layers: Optional[int] = _in(_COUNT, None)


@dataclass
class MLPConfig:
    _target_: str = "pipeckpt.app.models.MLP"
    in_features: int = _in(_COUNT)
    hidden: int = _in(_COUNT)
    depth: int = _in(_COUNT)  # hidden Linear+ReLU pairs
    num_classes: int = _in(_COUNT)
    lr: float = _in(_RATE)
    weight_decay: float = _in(_AT_LEAST_0)


@dataclass
class ConvNetConfig:
    _target_: str = "pipeckpt.app.models.ConvNet"
    in_channels: int = _in(_COUNT)
    width: int = _in(_COUNT)  # channels of the first conv; doubled twice
    num_classes: int = _in(_COUNT)
    lr: float = _in(_RATE)
    weight_decay: float = _in(_AT_LEAST_0)


@dataclass
class LlamaConfig:
    _target_: str = "pipeckpt.app.models.llama.Llama"
    size: str = MISSING  # a key of pipeckpt.app.models.llama.LLAMA_SIZES: tiny, 8B, 70B, 405B
    seq_len: int = _in(_COUNT)
    vocab_size: int = _in(_COUNT)  # the data's token range, within the size's vocabulary
    lr: float = _in(_RATE)
    weight_decay: float = _in(_AT_LEAST_0)
    tensor_parallel: int = _in(_COUNT, 1)  # build one tensor-parallel rank's share (pipeckpt.plan)


@dataclass
class HFConfig:
    _target_: str = "pipeckpt.app.models.hf.HFCausalLM"
    path: Optional[str] = MISSING  # a local pretrained directory, or a Hub id in the local cache
    config: Any = MISSING  # without a path: a dict of config.json's fields (model_type too) or a config.json
    layers: Optional[str] = MISSING  # the decoder layers' ModuleList; None: the one holding most parameters
    seq_len: int = _in(_COUNT)  # also the data's window length
    lr: float = _in(_RATE)
    weight_decay: float = _in(_AT_LEAST_0)
    trust_remote_code: bool = MISSING  # run the Python code a directory's config.json names (auto_map)
    ignore_keys: List[str] = MISSING  # regexes of the directory's keys to leave unread (else: refused)


# -- data/ ----------------------------------------------------------------------------


@dataclass
class TextDataConfig:
    _target_: str = "pipeckpt.app.data.TextDataModule"
    path: Optional[str] = MISSING  # None: the Python standard library's sources
    pattern: str = MISSING  # file-name glob inside a directory
    seq_len: int = _in(_COUNT)
    batch_size: int = _in(_COUNT)
    max_bytes: int = _in(_COUNT)  # corpus cap, read in file order
    val_fraction: float = _in(_FRACTION)  # the held-out tail of the corpus
    num_workers: int = _in(_AT_LEAST_0)


@dataclass
class HFTextDataConfig(TextDataConfig):
    _target_: str = "pipeckpt.app.data.HFTextDataModule"
    tokenizer: Optional[str] = MISSING  # a directory whose tokenizer makes the ids, if it holds one
    sample_prompt: Optional[str] = MISSING  # printed after training with the model's greedy continuation


@dataclass
class DatasetDataConfig:
    _target_: str = "pipeckpt.app.data.DatasetDataModule"
    path: str = MISSING  # a .jsonl/.json/.parquet/.csv/.arrow file, a directory of them, or save_to_disk's
    format: str = MISSING  # text, prompt_response or chat
    tokenizer: Optional[str] = MISSING  # the model's tokenizer directory
    seq_len: int = _in(_COUNT)
    batch_size: int = _in(_COUNT)
    text_field: str = MISSING
    prompt_field: str = MISSING
    response_field: str = MISSING
    messages_field: str = MISSING
    chat_template: Optional[str] = MISSING  # None: the tokenizer's own; chatml; or a Jinja file
    train_on_prompt: bool = MISSING  # labels on the prompt's tokens too
    packing: bool = MISSING  # several examples a row, never attending across
    too_long: str = MISSING  # truncate or drop rows longer than seq_len
    val_fraction: float = _in(_FRACTION)
    val_path: Optional[str] = MISSING  # the validation rows' own file (then val_fraction is unused)
    seed: int = _in(_SEED)
    num_workers: int = _in(_AT_LEAST_0)
    num_proc: Optional[int] = _in(_COUNT)  # tokenizing processes; None: the CPU cores for 10k+ rows
    sample_prompt: Optional[str] = MISSING  # printed after training with the model's greedy continuation


@dataclass
class _SyntheticConfig:
    """What every synthetic data set takes: its size, batch size and seed."""

    num_samples: int = _in(_COUNT)
    val_samples: int = _in(_COUNT)
    batch_size: int = _in(_COUNT)
    seed: int = _in(_SEED)


@dataclass
class SyntheticTokensConfig(_SyntheticConfig):
    _target_: str = "pipeckpt.app.data.SyntheticTokens"
    seq_len: int = _in(_COUNT)
    vocab_size: int = _in(_COUNT)
    steps: int = _in(_COUNT)


@dataclass
class SyntheticVectorsConfig(_SyntheticConfig):
    _target_: str = "pipeckpt.app.data.SyntheticVectors"
    in_features: int = _in(_COUNT)
    num_classes: int = _in(_COUNT)


@dataclass
class SyntheticImagesConfig(_SyntheticConfig):
    _target_: str = "pipeckpt.app.data.SyntheticImages"
    in_channels: int = _in(_COUNT)
    image_size: int = _in(Range(low=2))
    num_classes: int = _in(_COUNT)
    noise: float = _in(_AT_LEAST_0)


# -- strategy/ and ckpt/ --------------------------------------------------------------


def _pipe_strategy_config() -> Any:
    """The arguments of :class:`pipeckpt.PipelineStrategy`: :class:`~pipeckpt.settings.PipeSettings`'
    fields with their defaults, plus Hydra's ``_target_``. Generated, so that the settings
    have one source."""
    specs: List[Tuple[str, Any, Any]] = [("_target_", str, field(default="pipeckpt.PipelineStrategy"))]
    for f in fields(PipeSettings):
        specs.append((f.name, f.type, field(default=f.default, metadata=f.metadata)))
    return make_dataclass("PipeStrategyConfig", specs)


PipeStrategyConfig = _pipe_strategy_config()


@dataclass
class NamedStrategyConfig:
    """A strategy Lightning builds from its registry name (``auto``, ``ddp``)."""

    name: str = MISSING


def _settings_group(name: str, keys: Dict[str, str]) -> Any:
    """A group whose keys are settings under the app's names (``ckpt.modes`` is ``checkpoint``),
    with the settings' types and defaults; ``conf/strategy/pipe.yaml`` hands them to the strategy."""
    by_name = {f.name: f for f in fields(PipeSettings)}
    specs: List[Tuple[str, Any, Any]] = [
        (key, by_name[s].type, field(default=by_name[s].default, metadata=by_name[s].metadata))
        for key, s in keys.items()
    ]
    return make_dataclass(name, specs)


#: ``ckpt=<option>``: the checkpoint modes (a name, or a list of one per stage) and pinned offload.
CkptConfig = _settings_group("CkptConfig", {"modes": "checkpoint", "pin_memory": "pin_memory"})
#: ``memory.*``: what ``ckpt=auto`` plans to (the strategy's ``memory_*`` settings).
MemoryConfig = _settings_group(
    "MemoryConfig", {"budget": "memory_budget", "search": "memory_search", "optimizer": "memory_optimizer"}
)


# -- trainer/, logger/, callbacks ------------------------------------------------------


@dataclass
class TrainerConfig:
    """The Trainer arguments the app sets; any other stays Lightning's default."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = MISSING
    devices: Any = MISSING  # "auto", a count or a list of indices (set by the strategy config)
    num_nodes: int = _in(_COUNT)
    precision: str = MISSING  # 32-true, bf16-mixed, 16-mixed
    max_steps: int = _in(_AT_LEAST_MINUS_1)
    max_epochs: Optional[int] = _in(_AT_LEAST_MINUS_1)
    # steps (int) or fraction of an epoch (float); field() itself, as ruff reads any other call on an
    # Any-typed field as a shared mutable default
    val_check_interval: Any = field(default=MISSING, metadata={"range": _STEPS_OR_FRACTION})
    check_val_every_n_epoch: Optional[int] = _in(_COUNT)
    limit_val_batches: Any = field(default=MISSING, metadata={"range": _BATCHES_OR_FRACTION})
    limit_train_batches: Any = field(default=MISSING, metadata={"range": _BATCHES_OR_FRACTION})
    log_every_n_steps: int = _in(_AT_LEAST_0)
    num_sanity_val_steps: int = _in(_AT_LEAST_MINUS_1)
    gradient_clip_val: Optional[float] = _in(_AT_LEAST_0)
    accumulate_grad_batches: int = _in(_COUNT)
    enable_progress_bar: bool = MISSING
    deterministic: Any = MISSING
    default_root_dir: str = MISSING


@dataclass
class TrainConfig:
    """The whole training run."""

    model: Any = MISSING
    data: Any = MISSING
    strategy: Any = MISSING  # PipeStrategyConfig or NamedStrategyConfig
    ckpt: Any = field(default_factory=CkptConfig)  # the generated schema (typed by its value)
    memory: Any = field(default_factory=MemoryConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: Any = None  # a Lightning logger (_target_), or None for none
    callbacks: Any = None  # name -> callback (_target_)
    output_dir: str = MISSING  # the run directory; logs, checkpoints and the stage report go here
    seed: int = _in(_SEED)
    threads: Optional[int] = _in(_COUNT)  # torch.set_num_threads; None keeps torch's default
    ckpt_path: Optional[str] = MISSING  # a checkpoint to resume from
    validate: bool = MISSING  # validate before and after training, and print both losses
    # cluster=NAME: the devices strategy.layout=auto searches for (conf/cluster/: a preset's fields, or
    # name: local), checked field by field by pipeckpt.layout.cluster.cluster, naming cluster.<field>
    cluster: Any = None


_SCHEMAS: dict[tuple[Optional[str], str], Any] = {
    (None, "train_schema"): TrainConfig,
    ("model", "gpt_schema"): GPTConfig,
    ("model", "mlp_schema"): MLPConfig,
    ("model", "convnet_schema"): ConvNetConfig,
    ("model", "llama_schema"): LlamaConfig,
    ("model", "hf_schema"): HFConfig,
    ("data", "text_schema"): TextDataConfig,
    ("data", "hf_text_schema"): HFTextDataConfig,
    ("data", "dataset_schema"): DatasetDataConfig,
    ("data", "synthetic_schema"): SyntheticTokensConfig,
    ("data", "synthetic_vectors_schema"): SyntheticVectorsConfig,
    ("data", "synthetic_images_schema"): SyntheticImagesConfig,
    ("strategy", "pipe_schema"): PipeStrategyConfig,
    ("strategy", "named_schema"): NamedStrategyConfig,
    ("ckpt", "ckpt_schema"): CkptConfig,
}


def register() -> None:
    """Stores the schemas in Hydra's ConfigStore (idempotent); call before composing."""
    if not OmegaConf.has_resolver("pipeckpt_groups"):
        OmegaConf.register_new_resolver("pipeckpt_groups", _user_groups)
    if not OmegaConf.has_resolver("pipeckpt_local_dir"):
        OmegaConf.register_new_resolver("pipeckpt_local_dir", _local_dir)
    store = ConfigStore.instance()
    for (group, name), node in _SCHEMAS.items():
        store.store(group=group, name=name, node=node)


def _local_dir(value: Optional[str]) -> Optional[str]:
    """``model.path`` as the directory it names (a Hub id: its snapshot in the local cache), for the
    data's tokenizer (conf/data/hf_text.yaml)."""
    from pipeckpt.app.models.hf_directory import local_directory  # huggingface_hub, only for model=hf

    return None if value is None else str(local_directory(value))


def _user_groups() -> str:
    """The app's config groups and their options as the YAML files in ``conf/`` give them,
    for ``--help``: Hydra's own listing would also show the schemas stored above."""
    from hydra.core.hydra_config import HydraConfig

    roots = [
        Path(s.path.split("://", 1)[-1])
        for s in HydraConfig.get().runtime.config_sources
        if s.provider == "main"
    ]
    lines = []
    for root in roots:
        for group in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "hydra"):
            options = sorted(f.stem for f in group.glob("*.yaml"))
            lines.append(f"{group.name}: {', '.join(options)}")
    return "\n".join(lines)
