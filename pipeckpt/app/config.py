"""The schema of the app's Hydra configs (``conf/``), as dataclasses.

Why not YAML alone: it accepts any key and value, so ``chunk: 4`` or ``max_steps: ten`` would surface
late or never; registered in Hydra's ConfigStore, these dataclasses make them fail when the config is
composed. They check names and types only; pipeckpt's own validation checks values together. The
app's defaults live in the YAML files (fields here are ``MISSING``), except the strategy's settings
(``strategy``, ``ckpt``, ``memory``), generated from :class:`pipeckpt.settings.PipeSettings`
(with its defaults).
"""

from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from pipeckpt.settings import PipeSettings

__all__ = ["TrainConfig", "register"]


# -- model/ ---------------------------------------------------------------------------


@dataclass
class GPTConfig:
    _target_: str = "pipeckpt.app.models.GPT"
    size: str = MISSING  # a key of pipeckpt.app.models.SIZES: tiny, mini, small
    vocab_size: int = MISSING
    seq_len: int = MISSING  # also the data's window length
    dropout: float = MISSING
    lr: float = MISSING  # peak learning rate, after warm-up
    weight_decay: float = MISSING
    warmup_steps: int = MISSING
    d_model: Optional[int] = None  # None: the size's value
    n_heads: Optional[int] = None
    n_layers: Optional[int] = None


@dataclass
class MLPConfig:
    _target_: str = "pipeckpt.app.models.MLP"
    in_features: int = MISSING
    hidden: int = MISSING
    depth: int = MISSING  # hidden Linear+ReLU pairs
    num_classes: int = MISSING
    lr: float = MISSING
    weight_decay: float = MISSING


@dataclass
class ConvNetConfig:
    _target_: str = "pipeckpt.app.models.ConvNet"
    in_channels: int = MISSING
    width: int = MISSING  # channels of the first conv; doubled twice
    num_classes: int = MISSING
    lr: float = MISSING
    weight_decay: float = MISSING


# -- data/ ----------------------------------------------------------------------------


@dataclass
class TextDataConfig:
    _target_: str = "pipeckpt.app.data.TextDataModule"
    path: Optional[str] = MISSING  # None: the Python standard library's sources
    pattern: str = MISSING  # file-name glob inside a directory
    seq_len: int = MISSING
    batch_size: int = MISSING
    max_bytes: int = MISSING  # corpus cap, read in file order
    val_fraction: float = MISSING  # the held-out tail of the corpus
    num_workers: int = MISSING


@dataclass
class _SyntheticConfig:
    """What every synthetic data set takes: its size, batch size and seed."""

    num_samples: int = MISSING
    val_samples: int = MISSING
    batch_size: int = MISSING
    seed: int = MISSING


@dataclass
class SyntheticTokensConfig(_SyntheticConfig):
    _target_: str = "pipeckpt.app.data.SyntheticTokens"
    seq_len: int = MISSING
    vocab_size: int = MISSING
    steps: int = MISSING


@dataclass
class SyntheticVectorsConfig(_SyntheticConfig):
    _target_: str = "pipeckpt.app.data.SyntheticVectors"
    in_features: int = MISSING
    num_classes: int = MISSING


@dataclass
class SyntheticImagesConfig(_SyntheticConfig):
    _target_: str = "pipeckpt.app.data.SyntheticImages"
    in_channels: int = MISSING
    image_size: int = MISSING
    num_classes: int = MISSING
    noise: float = MISSING


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
    num_nodes: int = MISSING
    precision: str = MISSING  # 32-true, bf16-mixed, 16-mixed
    max_steps: int = MISSING
    max_epochs: Optional[int] = MISSING
    val_check_interval: Any = MISSING  # steps (int) or fraction of an epoch (float)
    check_val_every_n_epoch: Optional[int] = MISSING
    limit_val_batches: Any = MISSING
    limit_train_batches: Any = MISSING
    log_every_n_steps: int = MISSING
    num_sanity_val_steps: int = MISSING
    gradient_clip_val: Optional[float] = MISSING
    accumulate_grad_batches: int = MISSING
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
    seed: int = MISSING
    threads: Optional[int] = MISSING  # torch.set_num_threads; None keeps torch's default
    ckpt_path: Optional[str] = MISSING  # a checkpoint to resume from
    validate: bool = MISSING  # validate before and after training, and print both losses


_SCHEMAS: dict[tuple[Optional[str], str], Any] = {
    (None, "train_schema"): TrainConfig,
    ("model", "gpt_schema"): GPTConfig,
    ("model", "mlp_schema"): MLPConfig,
    ("model", "convnet_schema"): ConvNetConfig,
    ("data", "text_schema"): TextDataConfig,
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
    store = ConfigStore.instance()
    for (group, name), node in _SCHEMAS.items():
        store.store(group=group, name=name, node=node)


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
