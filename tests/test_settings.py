"""PipeSettings: one source for every setting of the pipe strategy.

The same invalid setting gives the same message from the Python API, from a Hydra
config and from the command line (one case per setting family), before any work;
the strategy's signature and the Hydra schema are the settings' own fields.
"""

import inspect
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List, get_type_hints

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from support import forkserver

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt.app.config import PipeStrategyConfig, register
from pipeckpt.settings import PipeSettings, PipeSettingsArgs

ROOT = Path(__file__).resolve().parents[1]

# family: (Python keyword arguments, the same as command-line overrides, a piece of the message)
CASES: Dict[str, tuple[Dict[str, Any], List[str], str]] = {
    "counts": ({"chunks": 0}, ["strategy.chunks=0"], "chunks=0: the number of micro-batches"),
    "layout": ({"balance": [0, 3]}, ["strategy.balance=[0,3]"], "balance=[0, 3]: must be a non-empty list"),
    "layout-agree": (
        {"stages": 3, "balance": [2, 2]},
        ["strategy.stages=3", "strategy.balance=[2,2]"],
        "stages=3 with balance [2, 2]",
    ),
    "balance_by": ({"balance_by": "luck"}, ["strategy.balance_by=luck"], "balance_by='luck'"),
    "modes": ({"checkpoint": "sometimes"}, ["ckpt.modes=sometimes"], "checkpoint mode 'sometimes'"),
    "compile": ({"compile": "fast"}, ["strategy.compile=fast"], "compile='fast': must be False, True"),
    "engine": ({"engine": "remote"}, ["strategy.engine=remote"], "engine='remote'"),
    "distributed-only": (
        {"schedule": "1f1b"},
        ["strategy.schedule=1f1b"],
        "schedule='1f1b' with engine='local'",
    ),
    "schedule": (
        {"engine": "distributed", "schedule": "zigzag"},
        ["strategy.engine=distributed", "strategy.schedule=zigzag"],
        "schedule='zigzag': must name a schedule",
    ),
    "timeout": (
        {"engine": "distributed", "timeout": 0},
        ["strategy.engine=distributed", "strategy.timeout=0"],
        "timeout=0",
    ),
}


def python_message(kwargs: Dict[str, Any]) -> str:
    with pytest.raises(PipeckptConfigError) as error:
        PipelineStrategy(**kwargs)
    return str(error.value)


def hydra_message(tmp_path: Path, overrides: List[str]) -> str:
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={tmp_path}", "strategy.stages=null", *overrides])
    with pytest.raises(Exception) as error:
        instantiate(cfg.strategy, _convert_="all")
    cause: BaseException | None = error.value
    while cause is not None and not isinstance(cause, PipeckptConfigError):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None, f"not a PipeckptConfigError: {error.value!r}"
    return str(cause)


@pytest.mark.parametrize("family", list(CASES))
def test_the_same_bad_setting_gives_the_same_message_from_python_and_hydra(tmp_path, family):
    kwargs, overrides, piece = CASES[family]
    message = python_message(kwargs)
    assert piece in message and "HINT:" in message
    assert hydra_message(tmp_path, overrides) == message


@pytest.mark.parametrize("family", ["counts", "modes", "distributed-only", "schedule"])
def test_the_command_line_prints_the_same_message_and_exits_1_before_training(tmp_path, family):
    kwargs, overrides, _ = CASES[family]
    done = forkserver.run(
        [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", "strategy.stages=null", *overrides],
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    # the app names a setting as its config does (strategy.schedule) where it checks it first
    said = python_message(kwargs)
    assert (
        f"Configuration error: {said}" in done.stderr
        or f"Configuration error: strategy.{said}" in done.stderr
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_an_unknown_setting_names_it_and_lists_the_settings():
    with pytest.raises(PipeckptConfigError, match=r"PipelineStrategy\(chunk=\.\.\.\).*'chunks'.*HINT"):
        PipelineStrategy(chunk=4)


def test_the_strategy_signature_is_the_settings_fields():
    params = inspect.signature(PipelineStrategy).parameters
    assert [n for n in params if n != "self"] == [f.name for f in fields(PipeSettings)]
    assert all(params[f.name].default == f.default for f in fields(PipeSettings))


def test_the_keyword_arguments_type_checkers_see_are_the_settings_fields():
    assert get_type_hints(PipeSettingsArgs) == get_type_hints(PipeSettings)


def test_the_hydra_schema_is_the_settings_fields_with_their_defaults():
    schema = {f.name: f.default for f in fields(PipeStrategyConfig)}
    assert schema.pop("_target_") == "pipeckpt.PipelineStrategy"
    assert schema == {f.name: f.default for f in fields(PipeSettings)}


def test_pipe_yaml_sets_only_what_the_app_chooses_differently():
    text = yaml.safe_load((ROOT / "conf" / "strategy" / "pipe.yaml").read_text())
    defaults = {f.name: f.default for f in fields(PipeSettings)}
    repeated = {k: v for k, v in text["strategy"].items() if k in defaults and v == defaults[k]}
    assert repeated == {}


def test_distributed_defaults_fill_in_only_for_the_distributed_engine():
    assert PipeSettings().schedule is None
    from pipeckpt.engines.distributed import DistributedEngine

    resolved = DistributedEngine.resolve(PipeSettings(engine="distributed"))
    assert (resolved.schedule, resolved.virtual_stages, resolved.timeout) == ("gpipe", 1, 60.0)


def test_help_lists_the_apps_groups_without_the_schemas():
    done = forkserver.run([sys.executable, "train.py", "--help"], cwd=ROOT, timeout=120)
    assert done.returncode == 0
    groups = done.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "strategy: ddp, pipe, single" in groups
    assert "schema" not in groups


def test_the_readme_lists_every_setting_with_its_default_and_meaning():
    readme = (ROOT / "docs" / "SETTINGS.md").read_text()  # the README points there
    for name, default, meaning in PipeSettings.help():
        assert f"| `{name}` | `{default}` | {meaning} |" in readme, name
