"""A ``pipeline_of`` model's own random draws outside its layers, under the local engine: before the
first layer call they come from the caller's generator, in micro-batch order (what the first stage's
process draws under the distributed engine); after a layer call they come from a stream of the
training call, the micro-batch and the count of layer calls so far (``layer_rng``'s ``AfterLayers``),
so they do not depend on what the other micro-batches drew, nor on which process runs the pass
(the end-to-end check is tests/engines/test_seven_models.py, T5 with dropout on)."""

from typing import Any, Dict, List, Tuple

import pytest
import torch
from support.toy import ToyModule, assert_bitwise_equal
from torch import Tensor, nn

from pipeckpt.boundaries.pipeline_of import pipeline_of
from pipeckpt.engines.local import LocalEngine
from pipeckpt.settings import PipeSettings

CPU = [torch.device("cpu")]
STREAMS_SEED, CALLER_SEED = 5, 7


class Between(nn.Module):
    """Dropout in the model's own code before its first layer and between its layers (as T5's encoder
    embedding and final dropouts), every mask recorded as ``(where, mask)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Tanh()) for _ in range(3))
        self.drop = nn.Dropout(0.5)
        self.masks: List[Tuple[str, Tensor]] = []

    def _dropped(self, where: str, h: Tensor) -> Tensor:
        mask = self.drop(torch.ones_like(h))
        self.masks.append((where, mask.ne(0)))
        return h * mask

    def forward(self, x: Tensor) -> Tensor:
        h = self.h[0](self._dropped("before", self.inp(x)))
        h = self.h[1](self._dropped("between", h))
        return self.h[2](self._dropped("between", h))


class BetweenModule(ToyModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Between()

    def configure_pipeline(self) -> Any:
        return pipeline_of(self.model, "h")


def pipelined(**settings: Any) -> BetweenModule:
    """The module with its model pipelined by the local engine in 2 micro-batches."""
    module = BetweenModule()
    engine = LocalEngine(PipeSettings(chunks=2, **settings))
    torch.manual_seed(STREAMS_SEED)  # the streams' seed: torch.initial_seed() when built
    engine.build(module, module.configure_pipeline(), CPU)
    return module


def masks(module: BetweenModule, where: str) -> List[Tensor]:
    return [m for w, m in module.model.masks if w == where]


def x(rows: int) -> Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(1))


def test_code_after_a_layer_draws_the_same_masks_whatever_the_earlier_microbatch_drew():
    # 4 rows: micro-batches of 2 and 2; 5 rows: 3 and 2. Micro-batch 1 is the same size in both,
    # micro-batch 0 draws more numbers in the second (before and between its layers).
    runs = []
    for rows in (4, 5):
        module = pipelined(balance=[1, 2])
        torch.manual_seed(CALLER_SEED)
        module.model(x(rows))
        runs.append(masks(module, "between"))  # micro-batch 0's two masks, then micro-batch 1's
    assert runs[0][0].shape != runs[1][0].shape
    assert torch.equal(runs[0][2], runs[1][2]) and torch.equal(runs[0][3], runs[1][3])


def test_code_before_the_first_layer_draws_from_the_callers_generator_in_microbatch_order():
    module = pipelined(balance=[1, 2])
    torch.manual_seed(CALLER_SEED)
    module.model(x(4))
    torch.manual_seed(CALLER_SEED)
    drop = nn.Dropout(0.5)
    expected = [drop(torch.ones(2, 16)).ne(0) for _ in range(2)]  # as the first stage's process draws
    after_them = torch.get_rng_state()
    got = masks(module, "before")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(torch.get_rng_state(), after_them)  # the masks after layers left it alone


def test_with_layer_rng_off_code_after_a_layer_draws_from_the_callers_generator():
    module = pipelined(balance=[1, 2], layer_rng="off")
    torch.manual_seed(CALLER_SEED)
    module.model(x(4))
    torch.manual_seed(CALLER_SEED)
    drop = nn.Dropout(0.5)
    # micro-batch 0: its mask before block 0, block 0's own mask, its mask between blocks 0 and 1
    before, _, between = [drop(torch.ones(2, 16)).ne(0) for _ in range(3)]
    assert torch.equal(masks(module, "before")[0], before)
    assert torch.equal(masks(module, "between")[0], between)


LAYOUTS = [([1, 2], "always"), ([2, 1], "except_last"), ([1, 1, 1], "offload")]


@pytest.mark.parametrize("balance, mode", LAYOUTS)
def test_dropout_after_a_layer_gives_gradients_bitwise_equal_under_every_layout_and_mode(balance, mode):
    def grads(balance: List[int], mode: str) -> Dict[str, Tensor]:
        module = pipelined(balance=balance, checkpoint=mode)
        torch.manual_seed(CALLER_SEED)
        for rows in (4, 6):  # two training calls
            module.model(x(rows)).pow(2).mean().backward()
        return {k: p.grad.clone() for k, p in module.model.named_parameters()}

    assert_bitwise_equal(grads(balance, mode), grads([3], "never"))
