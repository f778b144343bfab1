"""``pipeline_of`` under the distributed engine: the model's own random draws outside its named layers
do not depend on how many passes of a micro-batch a rank runs, nor on which rank runs them
(pipeckpt/engines/distributed/rooted.py): before the first layer call (an embedding dropout) from the
caller's generator, after a layer call (T5's encoder final dropout) from ``layer_rng``'s streams.
Without processes: :class:`RootRouting` driven by hand, as one rank holding stages 0 and 2 of a
looped schedule runs them, or as two ranks each holding one stage run them. The end-to-end checks
are tests/engines/distributed/test_distributed_equivalence.py (``skips_interleaved_mix``) and
tests/engines/test_seven_models.py (T5 with dropout on)."""

from typing import Any, Dict, List, Sequence, Tuple

import lightning as L
import torch
from torch import Tensor, nn

from pipeckpt import pipeline_of
from pipeckpt.checkpointing.layer_rng import LayerStreams
from pipeckpt.checkpointing.modes import parse_modes
from pipeckpt.engines.distributed.rooted import RootRouting
from pipeckpt.engines.local import LocalEngine
from pipeckpt.settings import PipeSettings
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


def _routing(
    model: nn.Module,
    held: Dict[int, Sequence[int]],
    ranges: Sequence[Tuple[int, int]] = RANGES,
    streams: Any = None,
) -> RootRouting:
    """The routing of a rank holding stages ``held`` (index -> its layers), with ``streams``."""
    routing = RootRouting(pipeline_of(model, "blocks"), ranges, NAMES)
    cpu = torch.device("cpu")
    mode = parse_modes(["never"], 1)[0]
    for j in held:
        blocks = model.blocks  # type: ignore[union-attr]
        stage = Stage(nn.Sequential(*(blocks[k] for k in held[j])), index=j, mode=mode, device=cpu)
        stage.begin_step(2)
        stage.streams = streams
        routing.stages[j] = stage
    return routing


def test_a_second_pass_of_a_microbatch_on_the_rank_draws_the_same_and_leaves_the_generator_alone():
    model, x = Dropped(), torch.ones(2, 4)
    routing = _routing(model, {0: [0], 2: [2]})
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
    routing = _routing(model, {0: [0]})
    torch.manual_seed(7)
    before = torch.get_rng_state()
    routing.run(0, live=False, microbatch=0, call=((x,), {}), received=[])
    assert len(model.seen) == 1  # the pass did draw a mask
    assert torch.equal(torch.get_rng_state(), before)


def test_a_new_step_records_its_microbatches_afresh():
    model, x = Dropped(), torch.ones(2, 4)
    routing = _routing(model, {0: [0]})
    for seed in (7, 8):  # two steps, the generator seeded differently before each
        torch.manual_seed(seed)
        routing.run(0, live=True, microbatch=0, call=((x,), {}), received=[])
    assert not torch.equal(model.seen[0], model.seen[1])  # step 2 did not replay step 1's state


class Between(nn.Module):
    """Dropout before the first named layer and after each of the first two (as T5's embedding, encoder
    final and decoder embedding dropouts), every mask recorded by name."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.drop = nn.Dropout(0.5)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.seen: List[Tuple[str, Tensor]] = []

    def _dropped(self, where: str, h: Tensor) -> Tensor:
        mask = self.drop(torch.ones_like(h))
        self.seen.append((where, mask.ne(0)))
        return h * mask

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks[0](self._dropped("before", x))
        h = self.blocks[1](self._dropped("between", h))
        return self.blocks[2](self._dropped("between", h))

    def masks(self, where: str) -> List[Tensor]:
        return [m for w, m in self.seen if w == where]


class _Holder(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_two_ranks_draw_the_local_engines_masks_before_and_after_a_layer():
    # Stage 0's rank ends its pass at block 1, so it never makes the draw after block 1: had that
    # draw come from the caller's generator, micro-batch 1's first mask would differ from the local
    # engine's, whose one process makes every draw of micro-batch 0 first.
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    local = Between()  # the local engine: 2 stages (block 0; blocks 1, 2), 2 micro-batches
    engine = LocalEngine(PipeSettings(chunks=2, balance=[1, 2]))
    torch.manual_seed(5)  # the streams' seed
    engine.build(_Holder(local), pipeline_of(local, "blocks"), [torch.device("cpu")])
    torch.manual_seed(7)
    local(x)
    streams = LayerStreams()  # each rank's: the same seed and training call as the local engine's
    streams.start(5)
    streams.next_call()
    ranges = [(0, 1), (1, 3)]
    first, second = Between(), Between()  # one rank per stage, each running its passes in turn
    rank0 = _routing(first, {0: [0]}, ranges, streams)
    rank1 = _routing(second, {1: [1, 2]}, ranges, streams)
    pieces = x.chunk(2)
    torch.manual_seed(7)  # the generators the processes agreed on
    sent = [rank0.run(0, live=True, microbatch=i, call=((pieces[i],), {}), received=[]) for i in range(2)]
    torch.manual_seed(7)
    for i in range(2):
        rank1.run(1, live=True, microbatch=i, call=((pieces[i],), {}), received=sent[i])
    for got, expected in [
        (first.masks("before"), local.masks("before")),  # stage 0's rank makes the ones before block 0
        (second.masks("between"), local.masks("between")),  # stage 1's rank the ones it reads
    ]:
        assert len(got) == len(expected) and all(torch.equal(g, e) for g, e in zip(got, expected))
