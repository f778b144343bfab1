"""Tiny Hugging Face causal LMs saved as pretrained directories (``save_pretrained`` in bf16, in many
safetensors shards; nothing downloaded), the model ``from_pretrained`` makes of one, and a
LightningModule that builds its model on the meta device in ``configure_model`` and fills it from
the directory (:func:`pipeckpt.pretrained`). Shared by the pretrained tests and their workers."""

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Set

import lightning as L
import safetensors
import torch
import transformers
from torch import Tensor, nn
from torch.utils.data import DataLoader

import pipeckpt
from pipeckpt.weights.ranged_read import SafetensorsFile
from support.hf_models import LAYERS, batches

LAYERS = dict(LAYERS, qwen2="model.layers")
SHARD = "8KB"  # 17 to 18 shards for these models
COMMON = dict(bos_token_id=0, eos_token_id=0, use_cache=False)


def config(name: str) -> Any:
    if name == "gpt2":  # tied input embedding and LM head (GPT-2's default)
        return transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **COMMON,
        )  # fmt: skip
    kind = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[name]
    return kind(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        attention_dropout=0.0, pad_token_id=0, **COMMON,
    )  # fmt: skip


def save(name: str, path: Path, *, seed: int = 1) -> Path:
    """A pretrained directory of model ``name`` (seeded random weights) in bf16 shards."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(name)).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size=SHARD)
    return path


def reference(path: Path) -> nn.Module:
    """What ``from_pretrained`` makes of ``path`` for fp32 training."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()


def tensor_keys(model: nn.Module) -> Set[str]:
    """The keys of ``model``'s tensors as its checkpoint names them (a tied one under either name)."""
    return set(model.state_dict())


@contextmanager
def keys_read() -> Iterator[List[str]]:
    """Every key read: by plain reads of its bytes (pipeckpt.weights.ranged_read), or through
    ``safetensors.safe_open``."""
    read: List[str] = []
    original = safetensors.safe_open
    ranged = SafetensorsFile.read_into

    def read_into(self, dest, key, offset):
        read.append(key)
        return ranged(self, dest, key, offset)

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = original(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.inner.get_tensor(key)

        def get_slice(self, key):
            read.append(key)
            return self.inner.get_slice(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    safetensors.safe_open = Recording
    SafetensorsFile.read_into = read_into
    try:
        yield read
    finally:
        safetensors.safe_open = original
        SafetensorsFile.read_into = ranged


class FromPretrained(L.LightningModule):
    """Fine-tunes the model of a pretrained directory: built on the meta device and filled from
    ``path`` (``build='meta'``), or ``from_pretrained`` in ``__init__`` (``build='eager'``)."""

    def __init__(self, name: str, path: Path, build: str = "meta") -> None:
        super().__init__()
        self.name, self.path = name, Path(path)
        self.model = reference(self.path) if build == "eager" else None

    def configure_model(self) -> None:
        if self.model is None:
            config = transformers.AutoConfig.from_pretrained(self.path)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            self.model = pipeckpt.pretrained(model, self.path)

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, LAYERS[self.name])

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    """Three batches of HF's dicts, each a step."""
    return DataLoader(batches(3), batch_size=None)


class FromScratch(FromPretrained):
    """Pretrains model ``name`` from its config's own initialisation, seeded with ``seed``: built
    on the meta device in ``configure_model`` (``build='meta'``) or eagerly in ``__init__``."""

    def __init__(self, name: str, build: str = "meta", seed: int = 5) -> None:
        L.LightningModule.__init__(self)
        self.name, self.seed, self.model = name, seed, None
        if build == "eager":
            self.configure_model()

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(self.seed)
            self.model = transformers.AutoModelForCausalLM.from_config(config(self.name))


def held_whole(module: nn.Module) -> Dict[str, Tensor]:
    """The tensors ``module`` holds for real, whole (an FSDP shard gathered), copied."""
    out = {}
    for k, v in module.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        if not v.is_meta:
            out[k] = v.detach().clone()
    return out


class HeldAtStart(L.Callback):
    """What the module's ``model`` holds when the fit starts, as ``read`` (:func:`held_whole`) reads it."""

    def __init__(self, read: Callable[[nn.Module], Dict[str, Any]] = held_whole) -> None:
        self.read = read
        self.held: Dict[str, Any] = {}

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.held = self.read(module.model)
