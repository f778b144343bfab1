"""The model ``python -m pipeckpt.plan`` profiles, built as a fit builds it, and the pipeline's input.

Why a module of its own: a fit builds a model in two steps, ``__init__`` (Hydra's ``instantiate``)
and Lightning's ``configure_model`` hook, which under the ``pipe`` strategy runs on the meta device
(the Hugging Face models of ``model=hf`` are built there, so that each process reads only its own
stages' weights). A plan that skipped the second step found no model to plan. Here both steps run:
on the meta device when the plan runs on fake tensors (then swapped for fake tensors of the same
shapes, :func:`~pipeckpt.memory.fake_weights.fake_weights`: nothing allocated), for real otherwise.
A ``pipeline_of`` model's input is the arguments ``training_step`` calls it with
(:func:`~pipeckpt.memory.budget.first_call`), not the batch: its own ``forward`` computes the loss.
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeckpt._errors import PipeckptConfigError, config_error
from pipeckpt.app.config import register
from pipeckpt.app.models.hf import HFCausalLM
from pipeckpt.app.models.hf_directory import local_directory
from pipeckpt.boundaries.contract import pipelined_sequential
from pipeckpt.boundaries.pipeline_of import ModulePipeline
from pipeckpt.layout.split_backward import HALVES, SplitBackward, measured
from pipeckpt.memory.budget import first_call, first_microbatch
from pipeckpt.memory.fake_weights import fake_weights
from pipeckpt.memory.precision import forward_context
from pipeckpt.memory.profile import ModelProfile, fake_mode, profile
from pipeckpt.memory.repeated import identical_run
from pipeckpt.memory.rooted import RootInput, root_chain

__all__ = [
    "Built",
    "built",
    "build",
    "loss",
    "batch",
    "joined",
    "plannable",
    "profiled",
    "split_timed",
    "three_layers",
]

#: The files a pretrained directory keeps its weights in (what ``from_pretrained`` reads).
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin")


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (the bundled models' loss, classifiers and GPT alike)."""
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def batch(cfg: DictConfig) -> Any:
    """The first training batch of the configured data (drawn for real: its seed is a real draw)."""
    return first_batch(instantiate(cfg.data))


def first_batch(datamodule: Any) -> Any:
    """``datamodule``'s first training batch: ``setup("fit")``, then its training loader's first."""
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def _weightless(cfg: DictConfig) -> Optional[Path]:
    """``model.path``'s directory when ``model=hf`` names one that holds a config.json and no
    weights: a plan reads shapes only, so the config alone plans it (a fit would refuse it)."""
    target = cfg.model.get("_target_")
    if not isinstance(target, str) or not issubclass(get_class(target), HFCausalLM):
        return None
    path = cfg.model.get("path")
    if path is None:
        return None
    directory = local_directory(str(path))
    has_config = (directory / "config.json").is_file()
    if not has_config or any((directory / name).exists() for name in WEIGHT_FILES):
        return None
    return directory


def plannable(cfg: DictConfig) -> Tuple[DictConfig, Optional[str]]:
    """``cfg`` as the plan builds it, and a line saying what changed (None: nothing): a ``model.path``
    directory without weights becomes ``model.config`` (the shapes are all a plan reads), the data's
    tokenizer still the directory's."""
    directory = _weightless(cfg)
    if directory is None:
        return cfg, None
    planned = cfg.copy()
    with open_dict(planned):
        if "tokenizer" in planned.get("data", {}):
            planned.data.tokenizer = cfg.data.tokenizer  # resolved while model.path still names it
        planned.model.path, planned.model.config = None, str(directory)
    return planned, f"model.path={cfg.model.path}: no weights in the directory, planned from its config.json"


def three_layers(cfg: DictConfig, full: torch.nn.Sequential) -> Optional[DictConfig]:
    """The configs of the same model with three of its identical layers (first, middle, last), where
    a ``pipeline_of`` model's layers are all alike and its ``model.config`` sets their count: its own
    forward runs every layer, so it is profiled shortened this way and the middle layer repeated
    (:func:`~pipeckpt.memory.repeated.repeat_layer`); None where that does not apply. Why: a profile
    on fake tensors costs more than linearly in the layers (torch's ``MemTracker`` walks its live
    tensors at every op): minutes for 80 blocks, seconds for three, the prediction the same."""
    config = cfg.model.get("config")
    alike = identical_run(full) == (0, len(full))
    if not isinstance(full, ModulePipeline) or len(full) <= 3 or not alike:
        return None
    if not isinstance(config, DictConfig) or cfg.model.get("path"):
        return None
    field = next((k for k in _layer_count_fields(full) if k in config), None)
    if field is None:
        return None
    short = cfg.copy()
    with open_dict(short):
        short.model.config[field] = 3
    return short


def _layer_count_fields(full: ModulePipeline) -> Tuple[str, ...]:
    """The config.json fields that may set the layers' count: ``num_hidden_layers``, and the model's
    own name for it by its config's ``attribute_map`` (GPT-2's ``n_layer``: a GPT-2 config was
    profiled whole, minutes for 24 blocks, once for every micro-batch size a search tries)."""
    config = getattr(getattr(full, "root", None), "config", None)
    own = (getattr(config, "attribute_map", None) or {}).get("num_hidden_layers")
    return ("num_hidden_layers", *((str(own),) if own else ()))


def build(cfg: DictConfig, extra: Dict[str, Any]) -> Any:
    """The configured module, ``configure_model`` run as a fit runs it (in the device and dtype
    context the caller sets); ``extra``: keyword arguments for the model (``tensor_parallel``)."""
    try:
        module = instantiate(cfg.model, **extra)
    except InstantiationException as error:
        if isinstance(error.__cause__, PipeckptConfigError):
            raise error.__cause__ from None
        if "tensor_parallel" not in extra:
            raise
        raise config_error(
            f"memory.tp={extra['tensor_parallel']} with model._target_={cfg.model._target_}",
            "the model is built as one tensor-parallel rank's share by its tensor_parallel "
            f"argument ({error})",
            "use a model that takes it (model=llama3) or drop memory.tp",
        ) from None
    hook = getattr(module, "configure_model", None)
    if callable(hook):
        hook()
    return module


@dataclass(frozen=True)
class Built:
    """A module the plan profiles, with its pipelined layers and one batch of their input.

    Args:
        module: the LightningModule, built (``configure_model`` run).
        sequential: what ``configure_pipeline()`` returns.
        inputs: one batch of the pipeline's input (a ``pipeline_of`` model's: its call's arguments).
        targets: the loss's target; None for a ``pipeline_of`` model, whose ``forward`` computes it.
    """

    module: Any
    sequential: torch.nn.Sequential
    inputs: Any
    targets: Any

    @property
    def loss_fn(self) -> Optional[Any]:
        return loss if self.targets is not None else None


def _pipeline_input(module: Any, sequential: torch.nn.Sequential, drawn: Any) -> Tuple[Any, Any]:
    if isinstance(sequential, ModulePipeline):
        return first_call(module, sequential, drawn), None
    inputs, targets = drawn
    return inputs, targets


@contextmanager
def built(
    cfg: DictConfig, drawn: Any, *, fake: bool, extra: Optional[Dict[str, Any]] = None
) -> Iterator[Built]:
    """Within: the module built for the plan on fake tensors (``fake``) or real ones, with the
    pipeline's input taken from the batch ``drawn``. On fake tensors the module is built on the meta
    device, as ``configure_model`` builds under the ``pipe`` strategy, and its tensors swapped for
    fake ones while the plan runs; a module that cannot be built there is built under the fake mode."""
    extra = extra or {}
    if not fake:
        module = build(cfg, extra)
        sequential = pipelined_sequential(module)
        yield Built(module, sequential, *_pipeline_input(module, sequential, drawn))
        return
    module = _on_meta(cfg, extra)
    if module is None:  # a build that reads a value it made: under the fake mode, as before
        with fake_mode():
            module = build(cfg, extra)
            sequential = pipelined_sequential(module)
            yield Built(module, sequential, *_pipeline_input(module, sequential, drawn))
        return
    sequential = pipelined_sequential(module)
    inputs, targets = _pipeline_input(module, sequential, drawn)
    with fake_weights(module, torch.device("cpu"), what="python -m pipeckpt.plan", fix=_FAKE_FIX):
        yield Built(module, sequential, inputs, targets)


def profiled(
    cfg: DictConfig, b: Built, microbatch: int, *, fake: bool, sequential: Optional[torch.nn.Module] = None
) -> ModelProfile:
    """One micro-batch of ``microbatch`` samples of the batch through ``b``'s layers (or
    ``sequential``, a shortened copy of them), under the run's precision: the plan's profile."""
    size = int(cfg.data.batch_size)
    with forward_context(cfg.trainer.precision, torch.device("cpu")):
        return profile(
            b.sequential if sequential is None else sequential,  # type: ignore[arg-type]
            first_microbatch(b.inputs, size // microbatch),
            loss_fn=b.loss_fn,
            target=first_microbatch(b.targets, size // microbatch) if b.targets is not None else None,
            fake=fake,
        )


def split_timed(cfg: DictConfig, b: Built, microbatch: int) -> SplitBackward:
    """A zero-bubble schedule's split backward of ``b``'s layers, timed here on one micro-batch of
    ``microbatch`` samples as the engine splits it (:mod:`pipeckpt.layout.split_backward`); a
    ``pipeline_of`` model's on the chain the profile runs (its layers as links, from its first
    layer's input, the code outside the layers after them: memory/rooted.py), since its stages
    split as a Sequential's do; halves where it cannot be timed."""
    size = int(cfg.data.batch_size)
    x = first_microbatch(b.inputs, size // microbatch)
    target = first_microbatch(b.targets, size // microbatch) if b.targets is not None else None
    with forward_context(cfg.trainer.precision, torch.device("cpu")), torch.random.fork_rng():
        if isinstance(b.sequential, ModulePipeline):
            chain = root_chain(b.sequential, RootInput.of(x))
            outside = chain.outside
            found = measured(chain.links, chain.first.detach(), lambda out, _: outside(out))
        else:
            found = measured(list(b.sequential), x, b.loss_fn, target)
    return found or HALVES


_FAKE_FIX = (
    "plan it on real tensors (memory.fake=false) where it fits, or plan a model whose step reads no value"
)


def _on_meta(cfg: DictConfig, extra: Dict[str, Any]) -> Optional[Any]:
    """The module built on the meta device, or None where its build cannot run there."""
    try:
        with torch.device("meta"):
            return build(cfg, extra)
    except PipeckptConfigError:
        raise
    except Exception:  # any other failure on meta only means: build it under the fake mode
        return None


def joined(rank: int, world: int, plain: Dict[str, Any], dtype: torch.dtype, scratch: str) -> DictConfig:
    """In a process a measurement spawned (:mod:`pipeckpt.plan_tp_host`, :mod:`pipeckpt.plan_fsdp_host`):
    the run's config from its unresolved container, the default dtype and torch threads a training
    process takes, and this process in a gloo group of ``world`` met through a file in ``scratch``."""
    register()  # the app's resolvers, which the unresolved config names
    cfg = OmegaConf.create(plain)
    torch.set_default_dtype(dtype)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    store = dist.FileStore(os.path.join(scratch, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return cfg
