"""The search a script's ``PipelineStrategy(layout="auto")`` runs when ``trainer.fit`` launches
(:mod:`pipeckpt.strategy_layout` names it by path): the cluster and the settings named checked, the
first training batch drawn, and the run's pick agreed as ``train.py strategy.layout=auto`` agrees
it (:func:`pipeckpt.plan_pick.agreed_pick`).

Why a module above the strategy: the search builds the app's models and prices the engines'
layouts, so it imports what imports the strategy.
"""

import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

from pipeckpt._rng import forked_random_states
from pipeckpt.layout.cluster import cluster as described
from pipeckpt.layout.pins import PINNABLE, Pins
from pipeckpt.plan_given import script_config
from pipeckpt.plan_model import first_batch
from pipeckpt.plan_pick import agreed_pick
from pipeckpt.strategy_layout import LayoutSearch

__all__ = ["pick_for"]


def pick_for(strategy: Any, module: Any, loaders: Any, datamodule: Any) -> Dict[str, Any]:
    """The run's pick for ``module`` trained by ``strategy`` on the fit's ``loaders`` or
    ``datamodule`` (or the module's own loader), the same on every process of the run."""
    search: LayoutSearch = strategy.layout_search
    if isinstance(search.cluster, Mapping) or search.cluster != "local":
        described(search.cluster)  # a preset's name or a description, checked field by field
    pins = Pins({k: v for k, v in search.named.items() if k in PINNABLE and v is not None})
    say = lambda *a, **k: rank_zero_info(" ".join(str(x) for x in a))  # noqa: E731
    # the batch drawn and the search run under a copy of every random state: the run draws on as if
    # nobody had
    with forked_random_states(), tempfile.TemporaryDirectory(prefix="pipeckpt-layout-") as folder:
        cfg = script_config(
            module,
            _first_batch(module, loaders, datamodule),
            Path(folder),
            settings=search.named,
            cluster=search.cluster,
            devices=strategy.num_processes,
            num_nodes=strategy.num_nodes,
            precision=str(strategy.precision_plugin.precision),
        )
        return agreed_pick(cfg, say, search.modes(), pins)


def _first_batch(module: Any, loaders: Any, datamodule: Any) -> Any:
    """The first training batch, drawn as the search's own configs draw theirs (the data module's,
    :func:`pipeckpt.plan_model.first_batch`); else the loader given's, or the module's own."""
    if isinstance(loaders, LightningDataModule):  # trainer.fit(model, datamodule) by position
        datamodule, loaders = loaders, None
    if loaders is None and datamodule is not None:
        return first_batch(datamodule)
    if loaders is None:
        loaders = module.train_dataloader()
    if isinstance(loaders, Mapping):  # several loaders: the first one's batch
        loaders = next(iter(loaders.values()))
    elif isinstance(loaders, (list, tuple)) and loaders and isinstance(loaders[0], DataLoader):
        loaders = loaders[0]
    return next(iter(loaders))
