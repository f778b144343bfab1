"""``pipeline_of`` under the distributed engine: the model's own random draws outside its named layers
(an embedding dropout) do not depend on how many passes of a micro-batch a rank runs
(pipeckpt/engines/distributed/rooted.py). Without processes: :class:`RootRouting` driven by hand, as
one rank holding stages 0 and 2 of a looped schedule runs them. The end-to-end check is
tests/engines/distributed/test_distributed_equivalence.py (``skips_interleaved_mix``)."""

from typing import Dict

import torch
from torch import Tensor, nn

from pipeckpt import pipeline_of
from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.engines.distributed.rooted import RootRouting
from pipeckpt.stages.stage import Stage

NAMES = ["blocks.0", "blocks.1", "blocks.2"]
RANGES = [(0, 1), (1, 2), (2, 3)]


class Dropped(nn.Module):
    """Dropout before the first named layer (outside the layers), then three blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.drop = nn.Dropout(0.5)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.seen: Dict[int, Tensor] = {}  # the mask of the last pass, by the stage that ran it

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(torch.ones_like(x))
        self.seen[len(self.seen)] = h.ne(0)
        return self.blocks[2](self.blocks[1](self.blocks[0](x * h)))


def _routing(model: Dropped, held: Dict[int, int]) -> RootRouting:
    """The routing of a rank holding stages ``held`` (index -> its layer)."""
    routing = RootRouting(pipeline_of(model, "blocks"), RANGES, NAMES)
    cpu = torch.device("cpu")
    mode = parse_modes(["never"], 1)[0]
    for j in held:
        stage = Stage(nn.Sequential(model.blocks[held[j]]), index=j, mode=mode, device=cpu)
        stage.begin_step(2)
        routing.stages[j] = stage
    return routing


def test_a_second_pass_of_a_microbatch_on_the_rank_draws_the_same_and_leaves_the_generator_alone():
    model, x = Dropped(), torch.ones(2, 4)
    routing = _routing(model, {0: 0, 2: 2})
    torch.manual_seed(7)
    sent = routing.run(0, live=True, microbatch=0, call=((x,), {}), received=[])
    after_first = torch.get_rng_state()
    sent.append((1, torch.zeros(2, 4)))  # stage 1's output, from the other rank
    routing.run(2, live=True, microbatch=0, call=((x,), {}), received=sent)
    assert torch.equal(model.seen[0], model.seen[1])  # stage 2's pass drew stage 0's mask
    assert torch.equal(torch.get_rng_state(), after_first)  # and micro-batch 1 draws as it would have
    routing.run(0, live=True, microbatch=1, call=((x,), {}), received=[])
    torch.manual_seed(7)
    drop = nn.Dropout(0.5)
    drop(torch.ones(2, 4))
    expected = drop(torch.ones(2, 4)).ne(0)  # the second mask of one pass per micro-batch
    assert torch.equal(model.seen[2], expected)


def test_a_shape_inference_pass_leaves_the_generator_untouched():
    model, x = Dropped(), torch.ones(2, 4)
    routing = _routing(model, {0: 0})
    torch.manual_seed(7)
    before = torch.get_rng_state()
    routing.run(0, live=False, microbatch=0, call=((x,), {}), received=[])
    assert len(model.seen) == 1  # the pass did draw a mask
    assert torch.equal(torch.get_rng_state(), before)


def test_a_new_step_records_its_microbatches_afresh():
    model, x = Dropped(), torch.ones(2, 4)
    routing = _routing(model, {0: 0})
    for seed in (7, 8):  # two steps, the generator seeded differently before each
        torch.manual_seed(seed)
        routing.run(0, live=True, microbatch=0, call=((x,), {}), received=[])
    assert not torch.equal(model.seen[0], model.seen[1])  # step 2 did not replay step 1's state
