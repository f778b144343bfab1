"""The local engine drops the previous step's gradients before the pipeline's forward, at the first
batch of an accumulation window (Lightning zeroes them between ``training_step`` and backward
anyway): no step holds a stale copy of the gradients through its forward. Inside a window, and for
a module that zeroes its gradients its own way, they stay. The weights are those of Lightning's own
order, bitwise."""

from typing import Any, List

from support.toy import ToyModule, assert_bitwise_equal, fit, params

from pipeckpt import PipelineStrategy


class GradProbe(ToyModule):
    """Notes, at each ``training_step``, whether any parameter still holds a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.held: List[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.held.append(any(p.grad is not None for p in self.parameters()))
        return super().training_step(batch, batch_idx)


class OwnZeroGrad(GradProbe):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)


def _pipe() -> PipelineStrategy:
    return PipelineStrategy(stages=2, chunks=2)


def test_no_training_step_starts_with_the_previous_steps_gradients():
    module = GradProbe()
    fit(module, _pipe(), steps=3)
    assert module.held == [False, False, False]


def test_gradients_accumulating_inside_a_window_are_kept():
    module = GradProbe()
    fit(module, _pipe(), steps=2, accumulate_grad_batches=2)
    assert module.held == [False, True, False, True]  # each window's second batch adds to its first


def test_a_module_zeroing_its_own_way_keeps_its_gradients_until_it_does():
    module = OwnZeroGrad()
    fit(module, _pipe(), steps=3)
    assert module.held == [False, True, True]


def test_the_weights_are_those_of_lightnings_own_order_bitwise():
    plain, piped = ToyModule(), ToyModule()
    fit(plain, "auto", steps=4, accumulate_grad_batches=2)
    fit(piped, PipelineStrategy(stages=2, chunks=1), steps=4, accumulate_grad_batches=2)
    assert_bitwise_equal(params(plain), params(piped))
