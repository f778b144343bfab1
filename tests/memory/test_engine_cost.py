"""memory/engine_cost: the time model charges every micro-batch of every stage the engine's own cost."""

import pytest
from harness.memory_models import model_of as _model
from harness.memory_models import profile_of as _profile

from pipeckpt.memory.engine_cost import LOCAL_ENGINE_S_PER_MICROBATCH, engine_s_per_microbatch
from pipeckpt.memory.predict import predict
from pipeckpt.stages.partition import plan

CPU = "cpu"


def _kernels_s(fitted, start: int, stop: int, last: bool) -> float:
    """One micro-batch's forward and backward of layers ``start:stop`` (and the loss on the last stage)."""
    layers = fitted.layers[start:stop]
    own = sum(layer.forward_s + layer.backward_s for layer in layers)
    loss = fitted.loss if last and fitted.loss is not None else None
    return own + (loss.forward_s + loss.backward_s if loss is not None else 0.0)


@pytest.mark.parametrize("schedule", ["local", "gpipe", "1f1b"])
def test_a_stage_without_recompute_takes_its_kernels_and_the_engines_cost_per_microbatch(schedule):
    seq, *_ = _model("mlp")
    fitted = _profile("mlp", 4)
    p = plan(seq, devices=[CPU], stages=3, checkpoint="never", chunks=4)
    got = predict(fitted, p, chunks=4, optimizer="sgd", schedule=schedule)
    engine = engine_s_per_microbatch(schedule == "local")
    for j, (start, stop) in enumerate(p.ranges):
        expected = 4 * (_kernels_s(fitted, start, stop, j == 2) + engine)
        assert got.stages[j].time_s == pytest.approx(expected, rel=1e-12), j


def test_more_smaller_microbatches_of_the_same_kernels_cost_the_engine_more_on_one_device():
    # The same profile at 2 and at 4 micro-batches (kernels of the same cost): the step on one device
    # grows by 2 x stages x the local engine's cost, which is what now breaks the tie for fewer chunks.
    seq, *_ = _model("mlp")
    fitted = _profile("mlp", 4)
    p = plan(seq, devices=[CPU], stages=3, checkpoint="never", chunks=4)
    two, four = (
        predict(fitted, p, chunks=m, optimizer="sgd", schedule="local", shared_device=True).step_time_s
        for m in (2, 4)
    )
    kernels = sum(_kernels_s(fitted, a, b, j == 2) for j, (a, b) in enumerate(p.ranges))
    assert four - two == pytest.approx(2 * (kernels + 3 * LOCAL_ENGINE_S_PER_MICROBATCH), rel=1e-9)
