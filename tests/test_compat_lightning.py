"""The private names of Lightning that pipeckpt reaches (pipeckpt/_compat/lightning_private.py),
split from tests/test_compat.py (torch's and torchgpipe's): one test per entry, asserting the
behaviour pipeckpt relies on, so an upgrade that removes or changes one fails here, by name.
"""

import inspect

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from pipeckpt import _compat


def test_lightning_module_device_follows_set_module_device():
    module = LightningModule()
    _compat.set_module_device(module, torch.device("meta"))
    assert module.device == torch.device("meta")


def test_lightning_distributed_helpers_keep_their_signatures():
    assert _compat.default_process_group_backend(torch.device("cpu")) == "gloo"
    assert "cluster_environment" in inspect.signature(_compat.init_dist_connection).parameters
    assert _compat.sync_ddp_if_available(torch.ones(1)).item() == 1.0  # no group: unchanged
    params = list(inspect.signature(_compat.SubprocessScriptLauncher).parameters)
    assert params[:3] == ["cluster_environment", "num_processes", "num_nodes"]


def test_unwrap_optimizer_finds_the_torch_optimizer_inside_lightnings():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    assert _compat.unwrap_optimizer(LightningOptimizer(opt)) is opt
    assert _compat.unwrap_optimizer(opt) is opt


def test_checkpoint_io_unset_until_someone_chooses_one():
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from lightning.pytorch.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy()
    assert _compat.checkpoint_io_unset(strategy)
    strategy.checkpoint_io = TorchCheckpointIO()
    assert not _compat.checkpoint_io_unset(strategy)


def test_hpc_checkpoint_path_numbers_after_the_highest_hpc_checkpoint(tmp_path):
    trainer = Trainer(default_root_dir=tmp_path, logger=False, accelerator="cpu", devices=1)
    assert _compat.hpc_checkpoint_path(trainer) == str(tmp_path / "hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_2.ckpt").mkdir()  # the distributed engine's sharded checkpoint is a folder
    assert _compat.hpc_checkpoint_path(trainer) == str(tmp_path / "hpc_ckpt_3.ckpt")


def test_saved_step_reads_and_sets_the_step_model_checkpoint_saved_last(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    trainer = Trainer(max_steps=3, callbacks=[callback], logger=False, enable_progress_bar=False)
    trainer.fit(_Tiny())
    assert _compat.saved_step(callback) == 2
    _compat.set_saved_step(callback, 3)
    assert _compat.saved_step(callback) == 3


def test_last_checkpoint_path_is_the_name_model_checkpoint_gives_this_runs_last_checkpoint(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run() -> tuple:
        callback = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
        return callback, Trainer(max_steps=2, callbacks=[callback], logger=False, enable_progress_bar=False)

    callback, trainer = run()
    assert _compat.last_checkpoint_path(callback, trainer) == str(tmp_path / "last.ckpt")
    (tmp_path / "last.ckpt").write_bytes(b"another run's")
    assert _compat.last_checkpoint_path(callback, trainer) == str(tmp_path / "last-v1.ckpt")
    callback.last_model_path = str(tmp_path / "last.ckpt")  # this run's own file keeps its name
    assert _compat.last_checkpoint_path(callback, trainer) == str(tmp_path / "last.ckpt")
    (tmp_path / "last-v1.ckpt").write_bytes(b"a third run's")
    callback, trainer = run()
    named = _compat.last_checkpoint_path(callback, trainer)
    trainer.fit(_Tiny())  # ModelCheckpoint names it itself
    assert named == callback.last_model_path == str(tmp_path / "last-v2.ckpt")


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 2)), batch_size=2)


def test_give_device_mesh_is_what_the_module_reads_as_device_mesh():
    module, mesh = LightningModule(), object()
    _compat.give_device_mesh(module, mesh)
    assert module.device_mesh is mesh


def test_sampler_follows_loader_makes_the_injected_training_sampler_shuffle_as_the_loader_does():
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False)
    data = TensorDataset(torch.arange(8))

    def injected(shuffle: bool) -> DistributedSampler:
        loader = DataLoader(data, shuffle=shuffle)
        connector = trainer._data_connector
        prepared = connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING)
        assert isinstance(prepared.sampler, DistributedSampler)
        return prepared.sampler

    assert injected(shuffle=False).shuffle  # Lightning's own: every training loader shuffled
    _compat.sampler_follows_loader(trainer)
    _compat.sampler_follows_loader(trainer)  # once only
    assert [injected(shuffle=s).shuffle for s in (False, True)] == [False, True]
    assert _compat.loader_shuffles(DataLoader(data, shuffle=True))


def test_fit_train_loader_reads_the_loader_passed_to_fit_before_the_fit_loop_sets_it_up():
    from torch.utils.data import DataLoader

    seen = []

    class Probe(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def setup(self, stage: str) -> None:
            seen.append(_compat.fit_train_loader(self.trainer))

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(torch.randn(4, 2), batch_size=2)
    Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False).fit(
        Probe(), loader
    )
    assert seen == [loader]


def test_configured_optimizers_reads_every_form_configure_optimizers_may_return():
    params = [nn.Parameter(torch.zeros(2))]
    sgd, adam = torch.optim.SGD(params, lr=0.1), torch.optim.Adam(params)
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, 1)
    assert _compat.configured_optimizers(sgd) == [sgd]
    assert _compat.configured_optimizers([sgd, adam]) == [sgd, adam]
    assert _compat.configured_optimizers(([sgd], [scheduler])) == [sgd]
    assert _compat.configured_optimizers({"optimizer": adam, "lr_scheduler": scheduler}) == [adam]
    assert _compat.configured_optimizers(None) == []


def test_sigterm_broadcast_turns_lightnings_per_batch_broadcast_off_and_on_for_one_trainer(monkeypatch):
    import inspect

    import lightning as L
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    sent = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda tensor, src: sent.append(tensor.item()))
    trainer, other = (L.Trainer(accelerator="cpu", logger=False) for _ in range(2))
    _compat.sigterm_broadcast(trainer, on=False)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert sent == []
    other.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # another Trainer keeps Lightning's
    assert sent == [0]
    _compat.sigterm_broadcast(trainer, on=True)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert sent == [0, 0]


def test_validates_after_this_step_tells_the_steps_a_validation_follows(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Record(Callback):
        def __init__(self) -> None:
            self.said: list[int] = []
            self.validated: list[int] = []

        def on_train_batch_end(self, trainer, *args) -> None:
            if _compat.validates_after_this_step(trainer):
                self.said.append(trainer.global_step)

        def on_validation_start(self, trainer, *args) -> None:
            self.validated.append(trainer.global_step)

    record = Record()
    trainer = Trainer(
        max_steps=7,
        val_check_interval=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        limit_train_batches=20,
    )
    trainer.fit(BoringModel())
    assert record.said == record.validated == [3, 6]


def test_start_local_ranks_starts_this_nodes_other_ranks_as_lightnings_launch_does(monkeypatch):
    import os
    import subprocess
    import sys

    from lightning.fabric.plugins.environments import LightningEnvironment

    started = []

    class Started:
        def __init__(self, command, env, cwd):
            started.append((list(command), env["LOCAL_RANK"], env["WORLD_SIZE"]))

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    monkeypatch.setattr(subprocess, "Popen", Started)
    launcher = _compat.SubprocessScriptLauncher(LightningEnvironment(), num_processes=3, num_nodes=1)
    _compat.start_local_ranks(launcher)
    assert [(rank, world) for _, rank, world in started] == [("1", "3"), ("2", "3")]
    assert all(command[0] == sys.executable for command, _, _ in started)
    assert len(launcher.procs) == 2


def test_split_threads_between_gives_each_process_its_share_unless_omp_num_threads_is_set(monkeypatch):
    import os

    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    try:
        _compat.split_threads_between(num_processes=2)
        share = int(os.environ["OMP_NUM_THREADS"])
        assert torch.get_num_threads() == share >= 1
        torch.set_num_threads(share + 1)
        _compat.split_threads_between(num_processes=2)  # OMP_NUM_THREADS is set now: left alone
        assert torch.get_num_threads() == share + 1
    finally:
        torch.set_num_threads(threads)


class _Recorded:
    """A launcher that records what Lightning hands ``launch``, and runs nothing."""

    is_interactive_compatible = True

    def __init__(self) -> None:
        self.calls: list = []

    def launch(self, function, *args, trainer=None, **kwargs):
        self.calls.append((function, args, kwargs))

    def kill(self, signum) -> None:
        pass


def _recording_trainer():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class Recording(SingleDeviceStrategy):
        configured = 0

        def _configure_launcher(self) -> None:
            self.configured += 1
            self._launcher = _Recorded()

    return Trainer(strategy=Recording(torch.device("cpu")), logger=False, enable_progress_bar=False)


def test_fit_arguments_reads_the_loaders_and_datamodule_lightnings_fit_hands_its_launcher():
    from lightning.pytorch import LightningDataModule

    trainer, loader = _recording_trainer(), [torch.zeros(1)]
    trainer.fit(LightningModule(), loader)
    trainer.fit(LightningModule(), datamodule=(data := LightningDataModule()))
    trainer.validate(LightningModule(), loader)
    fit, fit_data, validate = trainer.strategy.launcher.calls
    assert _compat.fit_arguments(*fit) == (loader, None)
    assert _compat.fit_arguments(*fit_data) == (None, data)
    assert _compat.fit_arguments(*validate) is None  # not a fit


def test_relaunch_makes_the_strategys_launcher_again():
    trainer = _recording_trainer()
    first = trainer.strategy.launcher
    _compat.relaunch(trainer.strategy)
    assert trainer.strategy.configured == 2 and trainer.strategy.launcher is not first
