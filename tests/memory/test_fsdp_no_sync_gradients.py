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


def test_without_gradient_sync_fsdp2_keeps_every_units_whole_gradient_in_the_reduce_dtype() -> None:
    # A one-process fake world of 2 (collectives do nothing; every buffer is real), bf16 compute.
    torch.manual_seed(0)
    layers = llama_layers(llama_config("tiny", seq_len=16))
    whole = sum(p.numel() for p in layers.parameters()) * 4  # float32 bytes, unsharded
    backward = _Backward()
    with fake_world(2) as mesh:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(layers, mesh=mesh, mp_policy=policy)
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
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(layers, mesh=mesh, mp_policy=policy)
        loss = layers(torch.randint(256, (2, 16))).float().logsumexp(-1).mean()
        with reducing_in_backward(layers):
            layers.set_requires_gradient_sync(False)
            layers.set_reshard_after_backward(False)
            loss.backward()
        sharded = sum(p.grad.to_local().numel() * 4 for p in layers.parameters() if p.grad is not None)
        assert "set_requires_gradient_sync" not in layers.__dict__  # the stage's setters are back
    assert sharded == rank_state(list(layers), Layout(fsdp=2, precision="bf16-mixed")).grads
