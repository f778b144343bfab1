"""The local engine's schedule on one thread: backward order, gradient sums, mixed
precision and what it refuses."""

import threading
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from support.toy import toy_layers
from torch import Tensor, nn

from pipeckpt import PipeckptConfigError
from pipeckpt._compat import TorchDispatchMode
from pipeckpt.engines.local.pipeline import LocalPipeline, clock_cycles
from pipeckpt.stages.partition import plan

CPU = [torch.device("cpu")]
MODES = ["never", "except_last", "always", "offload", ["always", "never", "except_last"]]


def engine(mode, *, seed: int = 0, chunks: int = 4, **kwargs) -> LocalPipeline:
    torch.manual_seed(seed)
    seq = toy_layers(depth=6, dropout=0.3)
    return LocalPipeline(
        seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint=mode), chunks=chunks, **kwargs
    )


def batch(seed: int = 2) -> Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))


def grads(pipe: LocalPipeline) -> Dict[str, Tensor]:
    seq = nn.Sequential(*[s.partition for s in pipe.stages])
    return {k: p.grad.clone() for k, p in seq.named_parameters()}


def train_steps(pipe: LocalPipeline, steps: int) -> Dict[str, Tensor]:
    """Backward ``steps`` times without zeroing: each step adds to the ``.grad`` of the last."""
    for step in range(steps):
        torch.manual_seed(10 + step)
        pipe.forward(batch(step)).pow(2).mean().backward()
    return grads(pipe)


def test_clock_cycles_are_gpipes_diagonals():
    assert clock_cycles(3, 2) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]


def test_every_stage_runs_on_the_calling_thread():
    threads = set()

    class Where(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            threads.add(threading.get_ident())
            return x

    seq = nn.Sequential(nn.Linear(8, 8), Where(), nn.Linear(8, 8), Where())
    pipe = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2], checkpoint="always"), chunks=4)
    pipe.forward(batch()).sum().backward()
    assert threads == {threading.get_ident()}


class BackwardOrder(nn.Module):
    """Records (stage, micro-batch) when the gradient reaches it in backward."""

    def __init__(self, stage: int, seen: List[Tuple[int, int]]) -> None:
        super().__init__()
        self.stage, self.seen, self.calls = stage, seen, 0

    def forward(self, x: Tensor) -> Tensor:
        i, self.calls = self.calls, self.calls + 1
        if x.requires_grad:
            x.register_hook(lambda g: self.seen.append((self.stage, i)))
        return x


@pytest.mark.parametrize("ordered", [False, True], ids=["one-device-default", "explicit-edges"])
def test_each_stage_runs_the_last_microbatch_backward_first(ordered):
    seen: List[Tuple[int, int]] = []
    seq = nn.Sequential(*[m for j in range(3) for m in (nn.Linear(8, 8), BackwardOrder(j, seen))])
    pipe = LocalPipeline(
        seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint="never"), chunks=4, ordered_backward=ordered
    )
    pipe.forward(batch()).sum().backward()
    for stage in range(3):
        assert [i for j, i in seen if j == stage] == [3, 2, 1, 0]


@pytest.mark.parametrize(
    "mode",
    [*MODES[1:], "always:1", "selective", "except_last+selective:1", ["selective", "always:1", "never"]],
    ids=str,
)
def test_gradients_added_to_existing_grads_are_bitwise_equal_to_never(mode):
    reference, other = train_steps(engine("never"), 2), train_steps(engine(mode), 2)
    for k in reference:
        assert torch.equal(reference[k], other[k]), k


@pytest.mark.parametrize("mode", ["never", "always"])
def test_explicit_backward_edges_leave_gradients_bitwise_unchanged(mode):
    reference = train_steps(engine(mode), 1)
    other = train_steps(engine(mode, ordered_backward=True), 1)
    for k in reference:
        assert torch.equal(reference[k], other[k]), k


def test_one_chunk_matches_the_unpipelined_layers_bitwise():
    torch.manual_seed(0)
    seq = toy_layers(depth=6)
    pipe = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2, 2], checkpoint="never"), chunks=1)
    x = batch()
    assert torch.equal(pipe.forward(x), seq(x))


class MatmulDtypes(TorchDispatchMode):
    """Dtypes of every matrix product, and each weight cast to bf16 by the data it reads."""

    MATMULS = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default}

    def __init__(self, weights: List[Tensor]) -> None:
        super().__init__()
        self.dtypes: List[torch.dtype] = []
        self.addmm = 0
        self.weight_ptrs = {w.data_ptr() for w in weights}
        self.casts: Dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS:
            self.dtypes += [a.dtype for a in args if isinstance(a, Tensor) and a.is_floating_point()]
            self.addmm += func is torch.ops.aten.addmm.default
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.weight_ptrs:
            self.casts[args[0].data_ptr()] = self.casts.get(args[0].data_ptr(), 0) + 1
        return func(*args, **(kwargs or {}))


def bf16_step(
    mode, region: Callable[[], Any] = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
) -> Tuple[LocalPipeline, MatmulDtypes]:
    pipe = engine(mode)
    weights = [
        s.partition[k].weight for s in pipe.stages for k in range(2) if hasattr(s.partition[k], "weight")
    ]
    weights += [
        s.partition[k][2].weight
        for s in pipe.stages
        for k in range(2)
        if isinstance(s.partition[k], nn.Sequential)
    ]
    with MatmulDtypes(weights) as probe:
        with region():
            out = pipe.forward(batch())
        out.float().pow(2).mean().backward()
    return pipe, probe


@pytest.mark.parametrize("mode, forward_runs", [("never", 4), ("always", 8)])
def test_bf16_autocast_runs_every_stages_matmuls_in_bf16(mode, forward_runs):
    _, probe = bf16_step(mode)
    assert set(probe.dtypes) == {torch.bfloat16}
    # 6 Linear layers over 3 stages, each run once per micro-batch (plus once per recompute)
    assert probe.addmm == 6 * forward_runs


@pytest.mark.parametrize("mode, casts", [("never", 1), ("always", 2)])
def test_each_weight_is_cast_once_per_forward_and_once_per_backward(mode, casts):
    """Not once per micro-batch (4) nor again in each recompute (4 more)."""
    _, probe = bf16_step(mode)
    assert len(probe.casts) == 6
    assert set(probe.casts.values()) == {casts}


@pytest.mark.parametrize("mode, casts", [("never", 4), ("always", 8)])
def test_under_lightnings_mixed_precision_each_forward_and_each_recompute_casts_its_own(mode, casts):
    """Lightning opens autocast without its cast cache: a recompute casts afresh as the micro-batch's
    forward did (4 micro-batches), keeping no cast past its own backward, as the memory model counts."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    _, probe = bf16_step(mode, MixedPrecision("bf16-mixed", "cpu").forward_context)
    assert len(probe.casts) == 6
    assert set(probe.casts.values()) == {casts}
    assert torch.autocast_increment_nesting() == 1  # no nesting level held after the step
    torch.autocast_decrement_nesting()


def test_a_stopped_backward_leaves_no_cast_cache_behind():
    pipe = engine("always")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe.forward(batch())

    def stop(_: Tensor) -> None:
        raise RuntimeError("stop")

    out.register_hook(stop)
    with pytest.raises(RuntimeError, match="stop"):
        out.float().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.forward(batch())
    # the next step let go of the held nesting level: leaving autocast empties the cache
    assert torch.autocast_increment_nesting() == 1
    torch.autocast_decrement_nesting()


def test_skip_connections_between_stages_are_refused():
    from torchgpipe.skip import pop, skippable, stash

    @skippable(stash=["skip"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return x

    @skippable(pop=["skip"])
    class Pop(nn.Module):
        def forward(self, x):
            return x + (yield pop("skip"))

    seq = nn.Sequential(Stash(), nn.Linear(8, 8), Pop())
    with pytest.raises(PipeckptConfigError, match=r"skip connections \['skip'\].*HINT: return the skipped"):
        LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 1], checkpoint="never"), chunks=2)
