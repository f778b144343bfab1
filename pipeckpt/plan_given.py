"""A LightningModule a script built, and its first training batch, as the search's configs: what
``PipelineStrategy(layout="auto")`` searches (:mod:`pipeckpt.strategy_layout`).

Why configs and not the live module: the search builds the model again, once per tensor-parallel
degree on fake tensors, and on ``cluster="local"`` for real in processes of its own that time a
split and a shard (:mod:`pipeckpt.plan_spawn`). A process of its own cannot take the script's
module (at its real size, or already on the meta device); it can build one from a recipe. A
LightningModule's recipe is Lightning's own, the one ``load_from_checkpoint`` uses: its class and
the arguments ``save_hyperparameters()`` kept. The batch goes by a file in a folder of the search's
own, read back with ``weights_only=True`` (tensors only: nothing is unpickled).
"""

import inspect
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeckpt._errors import config_error
from pipeckpt.strategy_layout import GIVEN, cut

__all__ = ["GivenBatch", "by_hand", "script_config"]


class GivenBatch(L.LightningDataModule):
    """The script's first training batch, read back from ``path``: the search's data."""

    def __init__(self, path: str, batch_size: int, seq_len: Optional[int] = None) -> None:
        super().__init__()
        self.path, self.batch_size, self.seq_len = path, batch_size, seq_len

    def train_dataloader(self) -> List[Any]:
        return [torch.load(self.path, weights_only=True)]


def _sequence_length(module: L.LightningModule, batch: Any) -> int:
    """Tokens per sample: the module's ``seq_len`` argument where it keeps one, else the second
    dimension of the batch's first tensor of token ids (``[samples, sequence]``)."""
    kept = module.hparams.get("seq_len")
    if isinstance(kept, int) and not isinstance(kept, bool):
        return kept
    leaves = cut(batch, 1).tensors
    ids = [t for t in leaves if t.dim() == 2 and not t.is_floating_point()]
    if not ids:
        shapes = [list(t.shape) for t in leaves]
        raise config_error(
            f"{GIVEN} with {type(module).__name__} and a first training batch of shapes {shapes}",
            "the search prices a layout by the tokens of a sequence model: a batch holding token "
            "ids [samples, sequence], or a seq_len argument the module keeps",
            "train a sequence model, or give the layout by hand (stages, dp, schedule, chunks)",
        )
    return int(ids[0].shape[1])


def _arguments(module: L.LightningModule) -> Dict[str, Any]:
    """The arguments that build ``module`` again: those ``save_hyperparameters()`` kept, checked to
    cover every argument its class takes (a default would build another model silently)."""
    cls = type(module)
    parameters = inspect.signature(cls.__init__).parameters
    taken = [
        n for n, p in parameters.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    anything = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    kept = {k: v for k, v in module.hparams.items() if anything or k in taken}  # as the class takes them
    missing = [n for n in taken if n not in kept]
    if missing:
        raise config_error(
            f"{GIVEN} with {cls.__name__}, whose arguments {missing} it did not keep",
            "the search builds the module again from its class and the arguments it was built with, "
            "as Lightning's load_from_checkpoint does (on fake tensors, and in processes of its own)",
            f"call self.save_hyperparameters() in {cls.__name__}.__init__, or give the layout by hand",
        )
    return kept


def script_config(
    module: L.LightningModule,
    batch: Any,
    folder: Path,
    *,
    settings: Dict[str, Any],
    cluster: Any,
    devices: int,
    num_nodes: int,
    precision: str,
) -> DictConfig:
    """The configs the search reads (:func:`pipeckpt.plan_layout.search_config`) for ``module`` and
    its first training ``batch`` (written into ``folder``): the module by its class and kept
    arguments, the batch as the global one, ``settings`` as the strategy's, on ``cluster``."""
    cls = type(module)
    path = folder / "batch.pt"
    torch.save(batch, path)
    model = {"_target_": f"{cls.__module__}.{cls.__qualname__}", **_arguments(module)}
    data = {
        "_target_": f"{GivenBatch.__module__}.{GivenBatch.__qualname__}",
        "path": str(path),
        "batch_size": cut(batch, 1).size,
        "seq_len": _sequence_length(module, batch),
    }
    try:
        return OmegaConf.create(
            {
                "seed": 0,
                "given_as": GIVEN,  # the search's lines name the strategy, not the configs
                "model": model,
                "data": data,
                "strategy": {**settings, "layout": "auto"},
                "trainer": {"devices": devices, "num_nodes": num_nodes, "precision": precision},
                "cluster": cluster if isinstance(cluster, str) else dict(cluster),
            }
        )
    except OmegaConfBaseException as error:
        raise config_error(
            f"{GIVEN} with {cls.__name__}'s kept arguments {sorted(model)[1:]}",
            "the search builds the module again from plain values (numbers, strings, lists): "
            + str(error).splitlines()[0],
            "keep plain values in save_hyperparameters (ignore=[...] the rest), or give the layout by hand",
        ) from None


def by_hand(settings: Dict[str, Any], global_batch: int) -> List[str]:
    """The strategy's arguments that train a pick's ``settings`` without a search, and the training
    loader's batch then: one replica's (under ``layout="auto"`` it is the global batch)."""
    given = ", ".join(f"{k}={v!r}" for k, v in settings.items() if v is not None)
    return [f"PipelineStrategy({given}),", f"batch_size={global_batch // int(settings['dp'])} per loader"]
