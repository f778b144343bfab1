"""What FSDP2 holds after a backward without gradient synchronisation, the way torch's
``PipelineStage`` runs every micro-batch's backward (``backward_maybe_with_nosync``:
``set_requires_gradient_sync(False)`` until the step's ``perform_reduce_grad``), and the memory
model's count of it (``RankState.grads_backward``, pipeckpt/memory/sharding.py): every unit's whole
gradient kept in the reduce dtype, nothing reduce-scattered (measured on the Llama's pp2 x dp2 FSDP
layouts: benchmarks/RESULTS_layout.md, "FSDP's gradients kept whole")."""

import weakref
from typing import List

import torch
from support.fake_world import fake_world
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from pipeckpt._compat import reducing_in_backward
from pipeckpt.app.models.llama import llama_config, llama_layers
from pipeckpt.memory.sharding import Layout, rank_state


class _Backward(TorchDispatchMode):
    """A weak reference to the storage of every float32 tensor an op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.made: List[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.made.append(weakref.ref(t.untyped_storage()))
        return out


def _shard(layers: torch.nn.Module, mesh: object) -> None:
    """Every layer an FSDP2 unit and the stack their root, as the engine shards a stage, bf16 compute."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(layers, mesh=mesh, mp_policy=policy)


def test_without_gradient_sync_fsdp2_keeps_every_units_whole_gradient_in_the_reduce_dtype() -> None:
    # A one-process fake world of 2 (collectives do nothing; every buffer is real), bf16 compute.
    torch.manual_seed(0)
    layers = llama_layers(llama_config("tiny", seq_len=16))
    whole = sum(p.numel() for p in layers.parameters()) * 4  # float32 bytes, unsharded
    backward = _Backward()
    with fake_world(2) as mesh:
        _shard(layers, mesh)
        layers.set_requires_gradient_sync(False)
        loss = layers(torch.randint(256, (2, 16))).float().logsumexp(-1).mean()
        with backward:
            loss.backward()
        kept = {id(s): s.nbytes() for s in (r() for r in backward.made) if s is not None}
        sharded = [p.grad for p in layers.parameters() if p.grad is not None]
    assert sum(kept.values()) == whole  # every unit's gradient, whole, in float32
    assert not sharded  # and no shard of it reduced yet
    assert rank_state(list(layers), Layout(fsdp=2, precision="bf16-mixed")).grads_backward == whole


def test_reducing_in_backward_keeps_fsdp2_reducing_whatever_the_stage_sets() -> None:
    # What the engine wraps a one-micro-batch stage's backward in: torch's stage sets gradient sync
    # off inside it (as here), and FSDP2 reduce-scatters each unit's gradient all the same.
    torch.manual_seed(0)
    layers = llama_layers(llama_config("tiny", seq_len=16))
    with fake_world(2) as mesh:
        _shard(layers, mesh)
        loss = layers(torch.randint(256, (2, 16))).float().logsumexp(-1).mean()
        with reducing_in_backward(layers):
            layers.set_requires_gradient_sync(False)
            layers.set_reshard_after_backward(False)
            loss.backward()
        sharded = sum(p.grad.to_local().numel() * 4 for p in layers.parameters() if p.grad is not None)
        assert "set_requires_gradient_sync" not in layers.__dict__  # the stage's setters are back
    assert sharded == rank_state(list(layers), Layout(fsdp=2, precision="bf16-mixed")).grads


def test_reducing_every_micro_batch_keeps_shards_and_leaves_the_gathered_units_to_the_stage() -> None:
    # What the engine wraps each micro-batch's backward in under reduce_every_microbatch: torch's
    # stage turns all three setters off inside it (as here); FSDP2 reduces every micro-batch's
    # gradient into the shards, and keeps each unit gathered as the stage asked (no reshard after
    # backward: the next micro-batch's forward gathers nothing again).
    torch.manual_seed(0)
    layers = llama_layers(llama_config("tiny", seq_len=16))
    layout = Layout(fsdp=2, precision="bf16-mixed", reduce_every_microbatch=True)
    state = rank_state(list(layers), layout)
    # FSDP2 holds the last reduce-scatter's input (the embedding's, reduced last) until the next
    retained = sum(p.numel() for p in layers[0].parameters()) * 4
    with fake_world(2) as mesh:
        _shard(layers, mesh)
        for _ in range(2):  # two micro-batches of one step
            loss = layers(torch.randint(256, (2, 16))).float().logsumexp(-1).mean()
            backward = _Backward()
            with reducing_in_backward(layers, reshard=False):
                for setter in (
                    "set_is_last_backward",
                    "set_reshard_after_backward",
                    "set_requires_gradient_sync",
                ):
                    getattr(layers, setter)(False)
                with backward:
                    loss.backward()
            kept = {id(s): s.nbytes() for s in (r() for r in backward.made) if s is not None}
            gathered = [not isinstance(next(layer.parameters()), DTensor) for layer in layers]
            assert sum(kept.values()) == state.grads + retained  # shards, no whole gradient
            assert all(gathered)  # kept for the next micro-batch, as the stage set
    assert state.grads_backward is None and state.reducing == 0  # nothing whole, nothing deferred
    assert state.collectives == state.synced_collectives >= retained  # a unit's gradient, its input
