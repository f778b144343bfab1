"""The distributed engine (`engine="distributed"`, one process per pipeline rank) before any step:
the topology it takes from the settings and the Trainer's world (pp x dp processes, replicas'
batches), the settings and worlds it refuses (each a PipeckptConfigError with a HINT), how a batch
becomes micro-batches, and SLURM's tasks against the Trainer's devices. No process is started.
"""

from typing import Any

import lightning as L
import pytest
import torch

from pipeckpt import PipeckptConfigError, PipeckptWarning, PipelineStrategy
from pipeckpt.engines.distributed import DistributedEngine
from pipeckpt.engines.distributed.step import PipelinedStep


def distributed(**kwargs: Any) -> PipelineStrategy:
    return PipelineStrategy(engine="distributed", **kwargs)


def trainer(strategy: PipelineStrategy, devices: int) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False)


def test_engine_distributed_drives_the_strategy_with_the_distributed_engine():
    strategy = distributed(balance=[3, 3])
    assert isinstance(strategy.engine, DistributedEngine)
    t = trainer(strategy, devices=2)
    assert t.strategy.is_distributed
    assert (t.strategy.engine.topology.pp, t.strategy.engine.topology.dp) == (2, 1)


def test_replicas_get_their_own_batches_and_stages_of_one_replica_the_same():
    t = trainer(distributed(balance=[3, 3], dp=2), devices=4)
    assert (t.strategy.engine.topology.pp, t.strategy.engine.topology.dp) == (2, 2)
    assert t.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_dp_that_does_not_divide_the_world_is_rejected():
    with pytest.raises(
        PipeckptConfigError, match=r"dp=3 with a world of 4.*pp x dp must equal the world size.*HINT"
    ):
        trainer(distributed(dp=3), devices=4)


@pytest.mark.parametrize(
    "settings, devices, rule",
    [
        (dict(stages=3, virtual_stages=2, schedule="interleaved_1f1b"), 2, "stages must divide evenly"),
        (
            dict(stages=4, dp=1, virtual_stages=2, schedule="interleaved_1f1b"),
            4,
            r"stages = pp x virtual_stages",
        ),
        (dict(stages=3), 2, "pp x dp must equal the world size"),
    ],
    ids=["virtual", "too-few-stages", "world"],
)
def test_stages_that_do_not_divide_into_the_processes_are_rejected(settings, devices, rule):
    with pytest.raises(PipeckptConfigError, match=rf"(?s){rule}.*HINT"):
        trainer(distributed(**settings), devices=devices)


def test_virtual_stages_need_the_interleaved_schedule():
    with pytest.raises(PipeckptConfigError, match=r"virtual_stages=2 with schedule='1f1b'.*HINT"):
        distributed(virtual_stages=2, schedule="1f1b")


def test_1f1b_with_fewer_microbatches_than_stages_is_rejected():
    with pytest.raises(
        PipeckptConfigError,
        match=r"chunks=2 with schedule='1f1b' on pp=4.*at least as many "
        r"micro-batches as pipeline stages.*HINT",
    ):
        trainer(distributed(chunks=2, schedule="1f1b"), devices=4)


def test_a_batch_chunks_does_not_divide_runs_with_fewer_microbatches_or_fails_clearly():
    engine = trainer(distributed(chunks=4, schedule="1f1b"), devices=2).strategy.engine
    step = PipelinedStep(None, None, [], engine.processes, chunks=4, device=torch.device("cpu"))
    with pytest.warns(PipeckptWarning, match=r"batch of 10 samples.*runs as 2 micro-batches.*HINT"):
        assert step.counts.of(10, train=True) == 2
    assert step.counts.of(3, train=True) == 3
    with pytest.raises(
        PipeckptConfigError,
        match=r"batch of 1 samples.*equal micro-batches.*at least as many "
        r"micro-batches as pipeline stages.*HINT: .*drop_last",
    ):
        step.counts.of(1, train=True)
    assert step.counts.of(1, train=False) == 1  # forward only: any count


def _slurm(monkeypatch: pytest.MonkeyPatch, name: str, per_node: int) -> None:
    for key, value in dict(
        SLURM_JOB_NAME=name,
        SLURM_NTASKS=str(per_node),
        SLURM_NTASKS_PER_NODE=str(per_node),
        SLURM_NNODES="1",
        SLURM_NODELIST="n1",
        SLURM_JOB_ID="7",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
    ).items():
        monkeypatch.setenv(key, value)


def test_devices_must_match_ntasks_per_node_under_slurm(monkeypatch):
    _slurm(monkeypatch, "train", per_node=4)
    with pytest.raises(
        PipeckptConfigError,
        match=r"devices=2 with SLURM --ntasks-per-node=4.*HINT: set the "
        r"trainer's devices=4",
    ):
        trainer(distributed(), devices=2)


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_a_slurm_job_named_like_a_shell_warns_that_slurm_is_ignored(monkeypatch, name):
    _slurm(monkeypatch, name, per_node=2)
    with pytest.warns(PipeckptWarning, match=rf"(?s)SLURM.*'{name}'.*ignores SLURM.*HINT"):
        trainer(distributed(), devices=2)
