"""A parameter shared by two stages on one device (a tied input embedding and LM head) is one
parameter: the gradients of both uses add up as in the unpipelined model, under every mode."""

from typing import Any, Dict

import pytest
import torch
from torch import Tensor, nn

from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

CPU = [torch.device("cpu")]
MODES = ["never", "except_last", "always", "offload", ["always", "never", "except_last"]]


class TiedHead(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding  # the same module, so the same weight

    def forward(self, h: Tensor) -> Tensor:
        return h @ self.embedding.weight.t()


def tied_layers(dropout: float) -> nn.Sequential:
    torch.manual_seed(0)
    embedding = nn.Embedding(11, 8)
    return nn.Sequential(
        embedding, nn.Linear(8, 8), nn.Dropout(dropout), nn.Tanh(), nn.Linear(8, 8), TiedHead(embedding)
    )


def tokens() -> Tensor:
    return torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(3))


def grads(seq: nn.Module) -> Dict[str, Tensor]:
    return {k: p.grad.clone() for k, p in seq.named_parameters()}


def pipelined(mode: Any, dropout: float) -> Dict[str, Tensor]:
    seq = tied_layers(dropout)
    pipe = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint=mode), chunks=4)
    torch.manual_seed(5)
    pipe.forward(tokens()).logsumexp(-1).mean().backward()
    return grads(seq)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_tied_weight_gradient_matches_the_unpipelined_model(mode):
    seq = tied_layers(0.0)
    seq(tokens()).logsumexp(-1).mean().backward()
    expected, got = grads(seq), pipelined(mode, 0.0)
    assert list(got) == [
        "0.weight",
        "1.weight",
        "1.bias",
        "4.weight",
        "4.bias",
    ]  # one key for the tied weight
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES[1:], ids=str)
def test_tied_weight_gradients_bitwise_equal_never_with_dropout(mode):
    expected, got = pipelined("never", 0.3), pipelined(mode, 0.3)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def accumulated(mode: Any, chunks: int) -> Dict[str, Tensor]:
    """Two backward passes without zeroing: the second adds to the tied weight's held gradient."""
    seq = tied_layers(0.3)
    pipe = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint=mode), chunks=chunks)
    for step in range(2):
        torch.manual_seed(5 + step)
        pipe.forward(tokens()).logsumexp(-1).mean().backward()
    return grads(seq)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("mode", MODES[1:], ids=str)
def test_tied_weight_gradients_added_to_held_ones_are_bitwise_equal_never(mode, chunks):
    # With one micro-batch a stage that recomputes nothing may skip its autograd Function, but
    # not one sharing a weight with another stage: the two uses would then be summed in another
    # order than under a recomputing mode.
    expected, got = accumulated("never", chunks), accumulated(mode, chunks)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
