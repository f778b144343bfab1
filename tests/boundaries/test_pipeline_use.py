"""A module whose first training step never calls the part configure_pipeline() returned
trains without pipeline or checkpointing; the local engine says so, naming the attribute."""

from typing import Any

import pytest
import torch.nn.functional as F
from support.toy import ToyModule, fit
from torch import Tensor

from pipeckpt import PipeckptConfigError, PipeckptWarning, PipelineStrategy


class Bypass(ToyModule):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = x
        for layer in self.layers:  # calls the layers one by one: the pipeline never runs
            h = layer(h)
        return F.cross_entropy(h, y)


def test_a_step_that_never_calls_the_pipeline_is_an_error_naming_the_attribute():
    with pytest.raises(
        PipeckptConfigError,
        match=r"Bypass\.training_step never called self\.layers: .*HINT: call self\.layers\(\.\.\.\)",
    ):
        fit(Bypass(), PipelineStrategy(stages=2, chunks=2), steps=1)


def test_a_step_that_calls_the_pipeline_passes_the_check():
    fit(ToyModule(), PipelineStrategy(stages=2, chunks=2), steps=2)


def test_not_strict_makes_it_a_warning():
    strategy = PipelineStrategy(stages=2, chunks=2, strict=False)
    with pytest.warns(PipeckptWarning, match=r"never called self\.layers"):
        fit(Bypass(), strategy, steps=1)
