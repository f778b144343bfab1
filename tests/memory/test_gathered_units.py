"""Which FSDP2 units a rank holds gathered at an op under ``reshard_after_forward``, as torch's
``PipelineStage`` runs them (pipeckpt/memory/gathered.py): measured on a one-process fake world
(torch's ``fake`` process group: collectives do nothing, every tensor is real), then the rule that
follows from it, op by op in the schedules' orders."""

from typing import List, Tuple

import torch
from support.fake_world import fake_world
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from pipeckpt.app.models.llama import llama_config, llama_layers
from pipeckpt.memory.gathered import gathered
from pipeckpt.memory.schedule import op_order

WHOLE, TWO = 4000, 1000  # every unit of a 4-layer stage gathered; the running and the prefetched one


def _gathered(layers: nn.Sequential) -> List[bool]:
    """Whether each unit's parameters are its gathered ones (FSDP2 swaps the sharded in on reshard)."""
    return [not isinstance(next(layer.parameters()), DTensor) for layer in layers]


def test_a_forward_after_a_backward_reshards_only_the_units_it_has_passed() -> None:
    torch.manual_seed(0)
    layers = llama_layers(llama_config("tiny", seq_len=16))
    seen: List[Tuple[int, List[bool]]] = []
    with fake_world(2) as mesh:
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(layers, mesh=mesh, reshard_after_forward=True)
        layers.set_requires_gradient_sync(False)  # as PipelineStage.backward_maybe_with_nosync sets them
        layers.set_reshard_after_backward(False)
        x = torch.randint(256, (2, 16))
        for k, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda m, a, k=k: seen.append((k, _gathered(layers))))
        layers(x).float().logsumexp(-1).mean().backward()
        assert _gathered(layers) == [True] * 4  # the backward's units stay gathered
        first, seen[:] = list(seen), []
        layers(x)
        assert _gathered(layers) == [False] * 4
    # Before any backward, the running unit only; after one, those the forward has not passed yet.
    assert first == [(k, [j == k for j in range(4)]) for k in range(4)]
    assert seen == [(k, [j >= k for j in range(4)]) for k in range(4)]


def test_in_1f1b_a_forward_after_a_backward_holds_the_units_it_has_not_reached() -> None:
    order = op_order("1f1b", stages=2, microbatches=4)[0][0]
    assert order == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    layers = (0, 4)
    assert gathered("F1 layer 2", layers, WHOLE, TWO, None, order) == TWO  # no backward yet
    assert gathered("F2 layer 1", layers, WHOLE, TWO, 1.0, order) == 2 * 1000 + TWO  # layers 2 and 3
    assert gathered("F2 layer 3", layers, WHOLE, TWO, 1.0, order) == TWO
    assert gathered("F2 loss", layers, WHOLE, TWO, 1.0, order) == 0


def test_in_1f1b_a_backward_after_a_forward_holds_the_units_whose_backward_it_has_run() -> None:
    order = op_order("1f1b", stages=2, microbatches=4)[0][0]
    layers = (0, 4)
    assert gathered("B1 loss", layers, WHOLE, TWO, 1.0, order) == 0
    assert gathered("B1 layer 3", layers, WHOLE, TWO, 1.0, order) == TWO
    assert gathered("B1 recompute layer 1", layers, WHOLE, TWO, 1.0, order) == 2 * 1000 + TWO
    assert gathered("B1 embeddings", layers, WHOLE, TWO, 1.0, order) == WHOLE
    assert gathered("B3 layer 3", layers, WHOLE, TWO, 1.0, order) == WHOLE  # right after B2: all kept


def test_in_gpipe_every_backward_after_the_first_holds_every_unit() -> None:
    order = op_order("gpipe", stages=2, microbatches=2)[0][1]
    assert gathered("B0 loss", (4, 8), WHOLE, TWO, 0.0, order) == 0
    assert gathered("B1 loss", (4, 8), WHOLE, TWO, 1.0, order) == WHOLE
    assert gathered("stage 1 B1 layer 7", (4, 8), WHOLE, TWO, 1.0, order) == WHOLE


def test_without_an_order_the_units_whose_gradients_are_held_count_gathered() -> None:
    # The looped schedules: the model has no order of their ops.
    assert gathered("stage 3 B2 layer 5", (4, 8), WHOLE, TWO, 0.5, None) == 2000 + TWO
    assert gathered("stage 3 B2 layer 5", (4, 8), WHOLE, TWO, 1.0, None) == WHOLE
    assert gathered("stage 3 F2 layer 5", (4, 8), WHOLE, TWO, None, None) == TWO
    assert gathered("stage 3 F2 loss", (4, 8), WHOLE, TWO, None, None) == 0
