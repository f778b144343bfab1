"""An engine is one module and one table row: a third engine, defined and registered here, trains,
saves and resumes through ``PipelineStrategy`` without any other file knowing it; and no file
outside ``pipeckpt/engines/`` compares an engine's name.
"""

import ast
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support.toy import ToyModule, assert_bitwise_equal, fit, params
from torch import nn

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt.engines import ENGINES, register
from pipeckpt.engines.local import LocalEngine
from pipeckpt.memory.budget import resolve_auto
from pipeckpt.settings import PipeSettings

ROOT = Path(__file__).resolve().parents[2]


class FakeEngine(LocalEngine):
    """The local engine under another name, counting what the strategy asks of it."""

    name = "fake"
    calls: Dict[str, int] = {}

    @classmethod
    def memory_schedule(cls, settings: PipeSettings) -> str:
        return "gpipe"  # what checkpoint='auto' plans under this engine, whatever the local one does

    def build(
        self, module: L.LightningModule, sequential: nn.Sequential, devices: Sequence[torch.device]
    ) -> None:
        FakeEngine.calls["build"] = FakeEngine.calls.get("build", 0) + 1
        super().build(module, sequential, devices)

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, *args: Any, **kwargs: Any) -> None:
        FakeEngine.calls["save"] = FakeEngine.calls.get("save", 0) + 1
        super().save_checkpoint(checkpoint, path, *args, **kwargs)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        FakeEngine.calls["load"] = FakeEngine.calls.get("load", 0) + 1
        return super().load_checkpoint(path, *args, **kwargs)


@pytest.fixture
def fake() -> Iterator[None]:
    register("fake", FakeEngine)
    FakeEngine.calls = {}
    yield
    ENGINES.pop("fake")


def _run(tmp_path: Path, *, ckpt_path: Any = None) -> L.Trainer:
    strategy = PipelineStrategy(engine="fake", balance=[2, 2, 2], chunks=2, checkpoint="always")
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    trainer = fit(
        ToyModule(dropout=0.3),
        strategy,
        steps=8,
        ckpt_path=ckpt_path,
        callbacks=[saves],
        enable_checkpointing=True,
    )
    assert isinstance(strategy.engine, FakeEngine) and strategy.plan is not None
    assert strategy.plan.balance == (2, 2, 2)
    return trainer


def test_a_registered_engine_trains_saves_and_resumes_through_the_strategy(
    fake: None, tmp_path: Path
) -> None:
    uninterrupted = params(_run(tmp_path / "first").lightning_module)
    assert FakeEngine.calls == {"build": 1, "save": 2}
    resumed = _run(tmp_path / "second", ckpt_path=tmp_path / "first" / "epoch=0-step=4.ckpt")
    assert resumed.global_step == 8 and FakeEngine.calls["load"] == 1
    assert_bitwise_equal(params(resumed.lightning_module), uninterrupted)


def test_a_registered_engine_refuses_the_settings_it_does_not_run(fake: None) -> None:
    with pytest.raises(PipeckptConfigError, match=r"schedule='1f1b' with engine='fake'.*HINT"):
        PipelineStrategy(engine="fake", schedule="1f1b")


def test_auto_plans_with_the_registered_engines_memory_schedule(fake: None) -> None:
    settings = PipeSettings(engine="fake", stages=2, chunks=2, checkpoint="auto", memory_budget="1GiB")
    module = ToyModule()
    auto = resolve_auto(settings, module.layers, devices=[torch.device("cpu")], batch=torch.randn(8, 8))
    assert auto.choice.prediction.schedule == "gpipe" and auto.settings.engine == "fake"


def test_an_unregistered_engine_is_a_config_error_naming_the_registered_ones() -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"engine='fake': must be one of \('local', 'distributed'\)"
    ):
        PipelineStrategy(engine="fake")


def _engine_name_comparisons(path: Path) -> List[str]:
    """``engine == "local"``, ``"distributed" != settings.engine``, ``engine in ("local", ...)``."""
    source = path.read_text()
    names = {name for name in ENGINES if isinstance(name, str)}
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        constants = [
            c.value
            for side in sides
            for c in ([side] if isinstance(side, ast.Constant) else getattr(side, "elts", []))
            if isinstance(c, ast.Constant)
        ]
        if names & set(constants) and "engine" in (ast.get_source_segment(source, node) or ""):
            found.append(f"{path}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_no_file_outside_the_engines_compares_an_engine_name() -> None:
    files = [p for p in (ROOT / "pipeckpt").rglob("*.py") if "engines" not in p.relative_to(ROOT).parts]
    found = [hit for p in [*files, ROOT / "train.py"] for hit in _engine_name_comparisons(p)]
    assert found == []


def test_the_grep_finds_an_engine_name_comparison(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('def f(s):\n    return s.engine == "local" or s.engine in ("distributed",)\n')
    assert len(_engine_name_comparisons(probe)) == 2
