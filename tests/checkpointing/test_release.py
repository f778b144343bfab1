"""A layer-by-layer recompute lets each saved tensor go at its node's use of it (checkpointing/release.py)."""

import weakref
from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from harness.stage_memory import StageTracker
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.checkpointing.release import ReleasedAtUnpack
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

CPU = [torch.device("cpu")]


class _FreedAtUnpack(torch.autograd.Function):
    """Saves its input; its backward records whether that input is gone once it drops its own copy,
    while the node is still running."""

    gone: List[bool] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        ref = weakref.ref(x)
        del x
        _FreedAtUnpack.gone.append(ref() is None)
        return grad * 3


def _gone_at_unpack(released: bool) -> bool:
    _FreedAtUnpack.gone.clear()
    a = torch.randn(8, requires_grad=True)
    with ReleasedAtUnpack() if released else torch.enable_grad():
        h = a * 2
        out = _FreedAtUnpack.apply(h)
    del h
    out.sum().backward()
    return _FreedAtUnpack.gone[0]


def test_a_saved_tensor_is_freed_at_its_unpack_not_when_its_node_ends() -> None:
    assert _gone_at_unpack(released=True)
    assert not _gone_at_unpack(released=False)  # autograd's own: held until the node has run


class _ReadsTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (_first,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        return grad * again.cos()


def test_unpacking_a_saved_tensor_twice_is_an_error_naming_the_fix() -> None:
    # as under torch.utils.checkpoint: a value kept for a second unpack would be held through its node
    a = torch.randn(8, requires_grad=True)
    with ReleasedAtUnpack():
        out = _ReadsTwice.apply(a * 2)
    with pytest.raises(RuntimeError, match=r"reads ctx.saved_tensors twice.*without ':k'"):
        out.sum().backward()


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])


def test_hooks_the_user_has_active_still_pack_and_unpack_every_recomputed_tensor() -> None:
    x = torch.randn(8, 16)
    reference = _stack()
    reference(x).sum().backward()
    seq = _stack()
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[2, 2], checkpoint="always:1"), chunks=2)
    calls = {"pack": 0, "unpack": 0}

    def pack(t: Tensor) -> Any:
        calls["pack"] += 1
        return ("mine", t)

    def unpack(packed: Any) -> Tensor:
        calls["unpack"] += 1
        assert packed[0] == "mine"
        return packed[1]

    out = engine.forward(x)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out.sum().backward()
    # per micro-batch (2), each layer's recompute saves its Linear's input and weight and its Tanh's
    # output, but the very first Linear's weight: its input needs no gradient
    assert calls == {"pack": 2 * (4 * 3 - 1), "unpack": 2 * (4 * 3 - 1)}
    for mine, theirs in zip(seq.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-7)


def _gpt() -> nn.Sequential:
    torch.manual_seed(0)
    return gpt_layers(vocab_size=256, d_model=64, n_heads=4, n_layers=4, seq_len=32, dropout=0.1)


def _peak_bytes(seq: nn.Sequential, run: Any, tokens: Tensor, targets: Tensor) -> int:
    tracker = StageTracker(1)
    tracker.exclude([*seq.parameters(), tokens, targets])
    torch.manual_seed(1)
    with tracker:
        F.cross_entropy(run(tokens).flatten(0, 1), targets.flatten()).backward()
    return tracker.peak[0]


def test_per_layer_recompute_peaks_no_higher_than_torch_checkpoint_per_block() -> None:
    # The frontier's per-block peer, at its own shape: embedding, norm and head plain, each block
    # checkpointed. Before the release, pipeckpt held a bias's summed gradient (64 floats, 256 bytes)
    # above it at the peak: an addmm's saved input lived through the rest of its node.
    tokens, targets = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    peer = _gpt()
    first, *blocks, norm, head = peer

    def per_block(x: Tensor) -> Tensor:
        h = first(x)
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return head(norm(h))

    theirs = _peak_bytes(peer, per_block, tokens, targets)
    seq = _gpt()
    stages = plan(seq, devices=CPU, balance=[1, 4, 2], checkpoint=["never", "always:1", "never"])
    ours = _peak_bytes(seq, LocalPipeline(seq, stages, chunks=1).forward, tokens, targets)
    assert ours <= theirs
