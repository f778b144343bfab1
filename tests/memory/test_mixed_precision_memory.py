"""Mixed precision in the memory model: a plan is profiled under the autocast region its step runs in,
so a ``bf16-mixed`` run's activations are counted at bf16's size, not at fp32's."""

from typing import Any, List, Tuple

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from harness.stage_memory import measure_device_step, measure_local_step, split_batch
from support.trainers import QUIET
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy
from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.memory.auto import process_peak
from pipeckpt.memory.precision import forward_context
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import profile
from pipeckpt.stages.partition import plan

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
CHUNKS = 2
#: Activations dominate: a block stack at sequence 128, whose weights are small beside them.
SHAPE = dict(vocab_size=256, d_model=128, n_heads=4, n_layers=4, seq_len=128, dropout=0.0)


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def _model_and_batch() -> Tuple[torch.nn.Sequential, Tensor, Tensor]:
    torch.manual_seed(0)
    seq = gpt_layers(**SHAPE)
    tokens = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(0))
    return seq, tokens[:, :-1], tokens[:, 1:]


def _predicted(precision: str, modes: List[str]) -> int:
    seq, x, y = _model_and_batch()
    with forward_context(precision, CPU):
        fitted = profile(seq, split_batch(x, CHUNKS), loss_fn=_loss, target=split_batch(y, CHUNKS), rounds=1)
    stage_plan = plan(seq, devices=[CPU], balance=[3, 4], checkpoint=modes, chunks=CHUNKS)
    return process_peak(fitted, stage_plan, chunks=CHUNKS, optimizer="sgd")


def _measured_under_bf16(modes: List[str]) -> int:
    """The whole process's peak of one step as a bf16-mixed Trainer runs it: forward and loss under
    Lightning's autocast, backward after it; every storage the step creates, parameters added."""
    seq, x, y = _model_and_batch()
    return measure_device_step(
        seq,
        plan(seq, devices=[CPU], balance=[3, 4], checkpoint=modes, chunks=CHUNKS),
        chunks=CHUNKS,
        batch=x,
        loss_fn=lambda out: _loss(out, y),
        forward_context=lambda: forward_context("bf16-mixed", CPU),
    )


@pytest.mark.parametrize("modes", [["never", "never"], ["always", "always"], ["always:1", "never"]])
def test_a_bf16_mixed_step_is_predicted_within_five_percent_when_profiled_under_its_autocast(modes) -> None:
    measured = _measured_under_bf16(modes)
    assert _predicted("bf16-mixed", modes) == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("mode", ["never", "except_last", "always", "always:1"])
def test_each_stage_of_a_bf16_mixed_step_is_predicted_within_half_a_percent(mode: str) -> None:
    # One device per stage, as the model predicts it: the harness copies each stage's input in.
    seq, x, y = _model_and_batch()
    with forward_context("bf16-mixed", CPU):
        fitted = profile(seq, split_batch(x, CHUNKS), loss_fn=_loss, target=split_batch(y, CHUNKS), rounds=1)
    stage_plan = plan(seq, devices=[CPU], balance=[3, 4], checkpoint=mode, chunks=CHUNKS)
    predicted = [s.peak for s in predict(fitted, stage_plan, chunks=CHUNKS, optimizer="sgd").stages]
    measured, _ = measure_local_step(
        seq,
        stage_plan,
        chunks=CHUNKS,
        batch=x,
        loss_fn=lambda out: _loss(out, y),
        forward_context=lambda: forward_context("bf16-mixed", CPU),
    )
    assert predicted == pytest.approx(measured, rel=0.005)


def test_an_fp32_profile_of_a_bf16_mixed_step_would_count_its_activations_a_third_too_large() -> None:
    # What the memory model predicted before it profiled under the step's autocast.
    modes = ["never", "never"]
    assert _predicted("32-true", modes) > 1.3 * _measured_under_bf16(modes)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "64-true"])
def test_a_precision_without_autocast_profiles_as_it_is(precision: str) -> None:
    assert not torch.is_autocast_enabled("cpu")
    with forward_context(precision, CPU):
        assert not torch.is_autocast_enabled("cpu")


def _fit(precision: str) -> PipelineStrategy:
    seq, x, y = _model_and_batch()

    class Blocks(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = seq

        def configure_pipeline(self) -> torch.nn.Sequential:
            return self.layers

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return _loss(self.layers(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    strategy = PipelineStrategy(
        balance=[3, 4], chunks=CHUNKS, checkpoint="auto", memory_budget="1GiB", memory_search=["modes"]
    )
    trainer = L.Trainer(**dict(QUIET, strategy=strategy, precision=precision, max_steps=1))
    trainer.fit(Blocks(), DataLoader(TensorDataset(x, y), batch_size=8))
    return strategy


def test_auto_under_a_bf16_mixed_trainer_plans_from_a_profile_under_its_autocast() -> None:
    # A budget every plan fits: never everywhere, whose peak is settled by memory alone.
    bf16, fp32 = _fit("bf16-mixed").auto_plan.choice, _fit("32-true").auto_plan.choice
    assert [m.name for m in bf16.modes] == [m.name for m in fp32.modes] == ["never", "never"]
    assert bf16.process_peak is not None and fp32.process_peak is not None
    # The Trainer's own step is profiled (no pipeline_loss here: backward from a gradient of ones),
    # its activations at bf16's size: before, the two plans were predicted the same.
    assert bf16.process_peak < 0.8 * fp32.process_peak
