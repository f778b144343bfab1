"""Every config in conf/ composes against the schema and builds its objects."""

from pathlib import Path

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from support.config_options import MODEL_OF_DATA, SETTINGS_OF_DATA, SETTINGS_OF_MODEL

import pipeckpt
from pipeckpt.app.config import register

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ["model", "data", "strategy", "ckpt", "trainer", "logger", "callbacks", "experiment"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_train(tmp_path: Path, *overrides: str, hydra: bool = False):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[f"output_dir={tmp_path}", *overrides], return_hydra_config=hydra)


def build(cfg) -> dict:
    """What train.py builds from a config, short of training."""
    strategy = instantiate(cfg.strategy, _convert_="all") if "_target_" in cfg.strategy else cfg.strategy.name
    return {
        "model": instantiate(cfg.model),
        "data": instantiate(cfg.data),
        "strategy": strategy,
        "logger": instantiate(cfg.logger) if cfg.logger else None,
        "callbacks": [instantiate(c) for c in (cfg.callbacks or {}).values()],
        "trainer": instantiate(cfg.trainer, strategy=strategy, logger=False),
    }


def test_every_group_has_options():
    assert all(options(group) for group in GROUPS)


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)], ids=lambda v: str(v))
def test_every_config_composes_and_builds(tmp_path, group, option):
    overrides = [f"{group}={option}"]
    if group == "data":
        overrides += [f"model={MODEL_OF_DATA[option]}", *SETTINGS_OF_DATA.get(option, [])]
    if group == "model":
        overrides += SETTINGS_OF_MODEL.get(option, [])
    if (group, option) == ("ckpt", "auto"):
        overrides.append("memory.budget=1GiB")  # auto plans to a budget; without one it is an error
    objects = build(compose_train(tmp_path, *overrides))
    assert isinstance(objects["model"], L.LightningModule)
    assert isinstance(objects["data"], L.LightningDataModule)
    assert isinstance(objects["trainer"], L.Trainer)


def test_default_is_tiny_gpt_on_text_with_a_two_stage_except_last_pipeline(tmp_path):
    objects = build(compose_train(tmp_path))
    strategy = objects["strategy"]
    assert isinstance(strategy, pipeckpt.PipelineStrategy)
    s = strategy.settings
    assert (s.stages, s.chunks, s.checkpoint) == (2, 4, "except_last")
    assert objects["model"].hparams.size == "tiny"
    assert type(objects["data"]).__name__ == "TextDataModule"


def test_a_model_brings_its_default_data_and_data_overrides_it(tmp_path):
    assert compose_train(tmp_path, "model=mlp").data._target_.endswith("SyntheticVectors")
    assert compose_train(tmp_path, "model=convnet").data._target_.endswith("SyntheticImages")
    assert compose_train(tmp_path, "model=gpt", "data=synthetic").data._target_.endswith("SyntheticTokens")


def test_a_per_stage_mode_list_reaches_the_strategy(tmp_path):
    cfg = compose_train(tmp_path, "strategy.stages=4", "ckpt.modes=[always,always,except_last,never]")
    assert build(cfg)["strategy"].settings.checkpoint == ["always", "always", "except_last", "never"]


def test_pin_memory_and_deferred_batch_norm_reach_the_strategy(tmp_path):
    cfg = compose_train(
        tmp_path, "ckpt=offload", "ckpt.pin_memory=false", "strategy.deferred_batch_norm=true"
    )
    s = build(cfg)["strategy"].settings
    assert (s.checkpoint, s.pin_memory, s.deferred_batch_norm) == (
        "offload",
        False,
        True,
    )


def test_single_strategy_is_lightning_auto_on_one_device(tmp_path):
    cfg = compose_train(tmp_path, "strategy=single")
    assert (cfg.strategy.name, cfg.trainer.devices) == ("auto", 1)


def test_precision_composes_as_a_lightning_precision(tmp_path):
    trainer = build(compose_train(tmp_path, "trainer.precision=bf16-mixed"))["trainer"]
    assert trainer.precision == "bf16-mixed"


def test_the_text_windows_follow_the_models_sequence_length(tmp_path):
    cfg = compose_train(tmp_path, "model.seq_len=64")
    assert cfg.data.seq_len == 64


@pytest.mark.parametrize(
    "override", ["strategy.chunk=4", "model.d_modle=64", "trainer.max_step=5", "ckpt.mode=always"]
)
def test_a_misspelled_key_fails_at_compose_time(tmp_path, override):
    with pytest.raises(ConfigCompositionException):
        compose_train(tmp_path, override)


@pytest.mark.parametrize(
    "override", ["trainer.max_steps=ten", "strategy.chunks=4.5", "strategy.balance=[a,b]"]
)
def test_a_wrongly_typed_value_fails_at_compose_time(tmp_path, override):
    with pytest.raises(ConfigCompositionException):
        compose_train(tmp_path, override)


def test_a_misspelled_key_in_a_config_file_fails_at_compose_time(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text("# @package _global_\nstrategy:\n  chunk: 4\n")
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises(ConfigCompositionException):
            compose("train", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "experiment=typo"])


def test_inside_a_slurm_job_the_run_dir_is_keyed_on_the_job_id(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cfg = compose_train(tmp_path, hydra=True)
    assert cfg.hydra.run.dir == "outputs/4242"
    assert cfg.hydra.sweep.dir == "multirun/4242"


def test_outside_slurm_the_run_dir_is_timestamped(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cfg = compose_train(tmp_path, hydra=True)
    assert cfg.hydra.run.dir.startswith("outputs/20")


def test_the_default_config_leaves_no_schema_field_unset(tmp_path):
    cfg = compose_train(tmp_path)
    assert not OmegaConf.missing_keys(cfg)
