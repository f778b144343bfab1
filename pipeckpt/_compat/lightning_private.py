"""Every reach into Lightning's private names (launcher, data connector, optimizer parser,
ModelCheckpoint's counters).

Each entry says why no public API serves; ``tests/test_compat_lightning.py`` checks each by name and
behaviour.
"""

import inspect
from typing import Any, List, Optional, Tuple

import torch
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning.fabric.utilities.distributed import (
    _init_dist_connection as init_dist_connection,
)

# How many threads each of a node's processes runs unless OMP_NUM_THREADS says: what Lightning's
# launcher sets once it has started them (see start_local_ranks).
from lightning.fabric.utilities.distributed import (
    _set_num_threads_if_needed as split_threads_between,
)
from lightning.fabric.utilities.distributed import (
    _sync_ddp_if_available as sync_ddp_if_available,
)

# DDPStrategy uses these for the same jobs; Lightning keeps them private.
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device

# What a checkpoint path may be (str or Path), as Lightning's strategies type their hooks.
from lightning.fabric.utilities.types import _PATH as LightningPath

# The launcher that starts one process per device on this node when no launcher
# (torchrun, srun) did; Lightning's own strategies import it the same way.
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from lightning.pytorch.trainer.states import RunningStage

# Lightning's own test of whether a loader shuffles (its saved ``shuffle`` argument, else its sampler).
from lightning.pytorch.utilities.data import _is_dataloader_shuffled as loader_shuffles


def sampler_follows_loader(trainer: Any) -> None:
    """Makes the ``DistributedSampler`` that ``trainer`` puts into a training loader shuffle only when
    the loader does (Lightning passes ``shuffle=True`` for every training loader). Only the Trainer's
    private data connector injects the sampler, with no setting for this, so its
    ``_prepare_dataloader`` is wrapped, on this Trainer only, once."""
    connector = trainer._data_connector
    if "_prepare_dataloader" in connector.__dict__:
        return
    prepare = connector._prepare_dataloader

    def following(dataloader: object, shuffle: bool, mode: Any) -> object:
        if mode == RunningStage.TRAINING:
            shuffle = loader_shuffles(dataloader)
        return prepare(dataloader, shuffle=shuffle, mode=mode)

    connector._prepare_dataloader = following


def checkpoint_io_unset(strategy: Any) -> bool:
    """Whether nobody chose the strategy's CheckpointIO: Lightning's ``checkpoint_io``
    property creates its default on first read, so only ``_checkpoint_io`` tells."""
    return getattr(strategy, "_checkpoint_io", None) is None


def hpc_checkpoint_path(trainer: Any) -> str:
    """The next ``hpc_ckpt_N.ckpt`` in the Trainer's root directory: the names Lightning resumes
    from under SLURM. Only its private checkpoint connector knows the numbering."""
    return str(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))


def saved_step(callback: Any) -> int:
    """The global step a ``ModelCheckpoint`` saved last; it keeps it only privately, to skip saving
    the same step twice."""
    return int(getattr(callback, "_last_global_step_saved", -1))


def set_saved_step(callback: Any, step: int) -> None:
    """Tells a ``ModelCheckpoint`` that ``step`` is saved (a ``last.ckpt`` written for it from
    outside), so that neither it nor a second final save writes the same step again."""
    callback._last_global_step_saved = step


def validates_after_this_step(trainer: Any) -> bool:
    """Whether the fit validates once this training step's hooks are done (Lightning asks its private
    ``_should_check_val_fx`` then, and runs the loop only when validation is enabled)."""
    loop = trainer.fit_loop.epoch_loop
    return bool(trainer.enable_validation and loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def last_checkpoint_path(callback: Any, trainer: Any) -> str:
    """The path a ``save_last`` ModelCheckpoint gives this run's last checkpoint now: the one it
    wrote (``last_model_path``), else ``last.ckpt`` under its template (``CHECKPOINT_NAME_LAST``),
    versioned ``last-v1.ckpt``, ``last-v2.ckpt``, ... past the files another run owns. The same
    steps as its private ``_save_last_checkpoint``, which picks the name only while it saves; the
    metrics the template reads come from its private ``_monitor_candidates``, and whether it
    versions at all from ``_enable_version_counter``. A collective (``file_exists``): every rank
    calls it."""
    metrics = callback._monitor_candidates(trainer)
    path = str(callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST))
    if callback._enable_version_counter:
        version = callback.STARTING_VERSION
        while callback.file_exists(path, trainer) and path != callback.last_model_path:
            path = str(callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST, ver=version))
            version += 1
    return path


def start_local_ranks(launcher: Any) -> None:
    """Starts this node's other ranks as Lightning's ``SubprocessScriptLauncher`` does (the script
    again, or ``-m module``, with ``LOCAL_RANK`` set and Hydra's run directory kept), into its
    ``procs``. Its ``launch`` does so in the private ``_call_children_scripts`` and then watches them
    with a private observer that SIGKILLs every process, the launching one included, when any one
    exits non-zero; a launcher that watches them otherwise
    (:mod:`pipeckpt.engines.distributed.children`) needs the first step without the second."""
    launcher._call_children_scripts()


def fit_arguments(function: Any, args: Any, kwargs: Any) -> Optional[Tuple[Any, Any]]:
    """``(train_dataloaders, datamodule)`` of the fit a launcher's ``launch`` was handed, or None
    for another entry point (validate, test, predict). Lightning hands ``launch`` its private
    ``_fit_impl`` with fit's arguments by position; they are read here by its parameters' names
    (``fit``'s own)."""
    try:
        signature = inspect.signature(function)
        bound = signature.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    if "train_dataloaders" not in signature.parameters:
        return None
    return bound.get("train_dataloaders"), bound.get("datamodule")


def relaunch(strategy: Any) -> None:
    """The strategy's launcher made again (its engine changed): Lightning's accelerator connector
    calls the protected ``_configure_launcher`` once, when the Trainer is built."""
    strategy._configure_launcher()


def fit_train_loader(trainer: Any) -> Any:
    """The training loader of the fit being set up: the one passed to ``fit``, else the datamodule's
    or the module's ``train_dataloader()`` (None when there is none). Lightning keeps where it comes
    from on the fit loop's private ``_data_source``; ``trainer.train_dataloader`` is set only later."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    if source is None or not source.is_defined():
        return None
    return source.dataloader()


def configured_optimizers(conf: Any) -> List[Any]:
    """The optimizers in what ``configure_optimizers`` returned, in every form Lightning accepts
    (an optimizer, lists, dicts, optimizers with schedulers), as Lightning's private parser reads it."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    return list(_configure_optimizers(conf)[0]) if conf is not None else []


def give_device_mesh(module: Any, mesh: Any) -> None:
    """Hands ``mesh`` to ``module.device_mesh`` (read in ``configure_model``), as Lightning's
    ``ModelParallelStrategy`` does: the property reads the private ``_device_mesh``, with no setter."""
    module._device_mesh = mesh


def sigterm_broadcast(trainer: Any, *, on: bool) -> None:
    """Turns Lightning's per-batch broadcast of rank 0's SIGTERM flag off (or back on) for this
    Trainer's fit loop. Lightning 2.6 runs this collective before every training batch whenever
    there are several processes, with no setting. While pipeckpt's SIGTERM handler answers SIGTERM
    (``state/termination.py``: the ranks agree at the step boundary), Lightning's handler never runs,
    so the flag is always 0: the collective only costs every rank a round each step. Set on the
    loop instance, so other Trainers keep Lightning's."""
    loop = trainer.fit_loop.epoch_loop
    if on:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)
    else:
        loop._broadcast_sigterm_tensor = _no_sigterm_broadcast


def _no_sigterm_broadcast() -> None:
    return None


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (kept in ``_optimizer``)."""
    return getattr(optimizer, "_optimizer", optimizer)


__all__ = [
    "LightningPath",
    "SubprocessScriptLauncher",
    "checkpoint_io_unset",
    "configured_optimizers",
    "fit_arguments",
    "relaunch",
    "default_process_group_backend",
    "fit_train_loader",
    "give_device_mesh",
    "hpc_checkpoint_path",
    "init_dist_connection",
    "last_checkpoint_path",
    "loader_shuffles",
    "optimizers_to_device",
    "sampler_follows_loader",
    "saved_step",
    "set_saved_step",
    "sigterm_broadcast",
    "split_threads_between",
    "start_local_ranks",
    "sync_ddp_if_available",
    "unwrap_optimizer",
    "validates_after_this_step",
]
