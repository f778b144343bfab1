"""The pp2 x tp2 x fsdp2 experiment (conf/experiment/llama_pp2_tp2_fsdp2.yaml) composes into a strategy
the distributed engine accepts for 8 processes, whose plan names the bundled Llama's layers. It
trains in tests/engines/distributed/test_distributed_tp.py (same plan, 8 processes)."""

from pathlib import Path

from test_configs import build, compose_train

from pipeckpt import PipelineStrategy
from pipeckpt.engines.distributed.tensor_parallel import check_plan


def test_the_tp_experiment_builds_pp2_x_tp2_x_fsdp2_on_8_processes(tmp_path: Path):
    objects = build(compose_train(tmp_path, "experiment=llama_pp2_tp2_fsdp2"))
    strategy = objects["trainer"].strategy
    assert isinstance(strategy, PipelineStrategy)
    topology = strategy.engine.topology  # resolved when the Trainer was built, before any process
    assert (topology.pp, topology.dp, topology.tp) == (2, 2, 2)
    assert strategy.settings.data_parallel == "fsdp"
    check_plan(list(objects["model"].configure_pipeline()), strategy.settings.tensor_parallel_plan)


def test_the_strategy_options_of_the_issue_compose_from_the_command_line(tmp_path: Path):
    cfg = compose_train(
        tmp_path,
        "strategy=pipe",
        "strategy.engine=distributed",
        "strategy.data_parallel=fsdp",
        "strategy.dp=2",
        "trainer.devices=4",
        "trainer.accelerator=cpu",
    )
    strategy = build(cfg)["trainer"].strategy
    assert (strategy.engine.topology.pp, strategy.engine.topology.dp) == (2, 2)


def test_the_sequence_parallel_experiment_builds_pp2_x_tp2_with_it_on_4_processes(tmp_path: Path):
    objects = build(compose_train(tmp_path, "experiment=hf_pp2_tp2_sp"))
    strategy = objects["trainer"].strategy
    assert isinstance(strategy, PipelineStrategy)
    topology = strategy.engine.topology
    assert (topology.pp, topology.dp, topology.tp) == (2, 1, 2)
    assert strategy.settings.sequence_parallel is True and strategy.settings.data_parallel == "fsdp"
