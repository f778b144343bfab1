"""The distributed engine refuses a torch whose pipelining lacks what it builds on, when the
strategy is made: on torch 2.11 (a GPU image's) it used to fail in the first backward, each rank
reporting a timeout."""

import pytest
import torch

import pipeckpt.engines.distributed.engine as distributed_engine
from pipeckpt import PipelineStrategy
from pipeckpt._errors import PipeckptConfigError


def test_a_torch_without_stage_metadata_hooks_is_refused_naming_its_version_and_the_fix(monkeypatch):
    monkeypatch.setattr(distributed_engine, "STAGE_META_HOOKS", False)
    with pytest.raises(PipeckptConfigError) as error:
        PipelineStrategy(engine="distributed", chunks=2)
    message = str(error.value)
    assert f"engine='distributed' with torch {torch.__version__}" in message
    assert "torch>=2.13" in message and "engine='local'" in message


def test_this_torch_has_the_hooks_and_the_strategy_is_made():
    assert distributed_engine.STAGE_META_HOOKS
    PipelineStrategy(engine="distributed", chunks=2)
