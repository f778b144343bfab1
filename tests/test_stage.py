"""Stages under the local engine: how often each stage runs, and that
checkpointing never changes the numbers."""

from typing import Dict, List

import pytest
import torch
from torch import nn
from toy import Counter, toy_layers

from pipeckpt.engines.local_pipeline import LocalPipeline
from pipeckpt.planning import plan

CPU = [torch.device("cpu")]
MIXES = ["never", "except_last", "always", "offload", ["always", "never", "except_last"]]


def counted(depth: int = 6, dropout: float = 0.3) -> nn.Sequential:
    """Layers with a Counter at the head of each of 3 stages of 2 layers."""
    torch.manual_seed(0)
    layers = list(toy_layers(depth=depth, dropout=dropout))
    return nn.Sequential(
        *[nn.Sequential(Counter(), layer) if i % 2 == 0 else layer for i, layer in enumerate(layers)]
    )


def run(mode, *, chunks: int = 4, batch: int = 8, seq: nn.Sequential = None) -> LocalPipeline:
    seq = seq if seq is not None else counted()
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint=mode), chunks=chunks)
    torch.manual_seed(1)
    out = engine.forward(torch.randn(batch, 8, generator=torch.Generator().manual_seed(2)))
    out.pow(2).mean().backward()
    return engine


def counts(engine: LocalPipeline) -> List[int]:
    return [s.partition[0][0].calls for s in engine.stages]


@pytest.mark.parametrize(
    "mode, per_stage",
    [
        ("never", 4),
        ("except_last", 7),
        ("always", 8),
        ("offload", 8),
    ],
)
def test_each_stage_runs_forward_once_per_microbatch_plus_recomputes(mode, per_stage):
    assert counts(run(mode)) == [per_stage] * 3


def test_per_stage_modes_recompute_only_their_own_stage():
    assert counts(run(["always", "never", "except_last"])) == [8, 4, 7]


def test_no_recompute_without_grad():
    seq = counted()
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint="always"), chunks=4)
    with torch.no_grad():
        engine.forward(torch.randn(8, 8))
    assert counts(engine) == [4, 4, 4]


def grads(engine: LocalPipeline) -> Dict[str, torch.Tensor]:
    seq = nn.Sequential(*[s.partition for s in engine.stages])
    return {k: p.grad.clone() for k, p in seq.named_parameters()}


@pytest.mark.parametrize("mode", MIXES[1:], ids=str)
def test_gradients_with_dropout_are_bitwise_equal_to_never(mode):
    reference, other = grads(run("never")), grads(run(mode))
    for k in reference:
        assert torch.equal(reference[k], other[k]), k


def test_recompute_leaves_batchnorm_running_statistics_as_never_does():
    def bn_layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.BatchNorm1d(8))

    never, always = bn_layers(), bn_layers()
    for seq, mode in ((never, "never"), (always, "always")):
        engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2], checkpoint=mode), chunks=2)
        engine.forward(torch.randn(8, 8, generator=torch.Generator().manual_seed(3))).sum().backward()
    for a, b in zip(never.buffers(), always.buffers()):
        assert torch.equal(a, b)


def test_fewer_samples_than_chunks_runs_fewer_microbatches_with_a_warning():
    from pipeckpt import PipeckptWarning

    with pytest.warns(PipeckptWarning, match=r"a batch of 3 samples makes only 3 micro-batches for chunks=4"):
        engine = run("never", chunks=4, batch=3)
    assert counts(engine) == [3, 3, 3]


def test_a_flop_counter_around_the_pipeline_sees_every_stages_forward():
    from torch.utils.flop_counter import FlopCounterMode

    def flops(pipelined: bool) -> int:
        torch.manual_seed(0)
        seq = toy_layers(depth=6)
        x = torch.randn(8, 8)
        run_ = (
            LocalPipeline(
                seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint="never"), chunks=4
            ).forward
            if pipelined
            else seq
        )
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            run_(x)
        return counter.get_total_flops()

    assert flops(pipelined=True) == flops(pipelined=False) > 0
