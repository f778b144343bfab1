"""MemoryCheck: measured against predicted per-stage peak, and the warning when measured is higher."""

import warnings

import lightning as L
import pytest
from support.trainers import QUIET

from pipeckpt import PipelineStrategy
from pipeckpt._errors import PipeckptWarning
from pipeckpt.app.data import SyntheticVectors
from pipeckpt.app.models import MLP
from pipeckpt.report.memory_check import MemoryCheck

pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(callback: MemoryCheck, checkpoint="never") -> MLP:
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=PipelineStrategy(stages=2, chunks=4, checkpoint=checkpoint),
        devices=1,
        max_steps=3,
        **QUIET,
        callbacks=[callback],
    )
    model = MLP(in_features=32, hidden=256, depth=4, num_classes=10, lr=0.01, weight_decay=0.0)
    data = SyntheticVectors(
        in_features=32, num_classes=10, num_samples=64, val_samples=16, batch_size=16, seed=0
    )
    trainer.fit(model, data)
    return model


def test_a_prediction_below_the_measured_peak_warns_naming_the_stage() -> None:
    callback = MemoryCheck(step=1, predicted=[1024, 1024])
    with pytest.warns(PipeckptWarning, match=r"stage 0: measured .* predicted 0.00 MiB.*stage 1: measured"):
        _fit(callback)


def test_the_measured_figure_counts_at_least_each_stages_parameters_gradients_and_adam_state() -> None:
    callback = MemoryCheck(step=1, predicted=[2**40, 2**40])
    model = _fit(callback)
    layers = list(model.layers)
    params = [
        sum(p.numel() * 4 for layer in layers[a:b] for p in layer.parameters()) for a, b in [(0, 4), (4, 9)]
    ]
    # parameters + gradients + AdamW's two moments = 4x the parameters, plus activations on top.
    assert all(m >= 4 * p for m, p in zip(callback.measured, params)), (callback.measured, params)
    assert all(m < 4 * p + 2**20 for m, p in zip(callback.measured, params))  # activations: well under 1 MiB


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_the_memory_models_own_prediction_raises_no_warning(checkpoint) -> None:
    callback = MemoryCheck(step=1, optimizer="adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipeckptWarning)
        _fit(callback, checkpoint)
    assert callback.predicted is not None and len(callback.measured) == 2
    assert all(m <= 1.1 * p for m, p in zip(callback.measured, callback.predicted))
