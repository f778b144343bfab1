"""FSDP2's collective buffers (a unit's unsharded gradient, and with gradient sync on, as a module
outside a ``pipeline_of`` model's layers has it, its reduce-scatter input) exist only once the unit's
backward has made its gradient, so a rank's peak before any gradient is made (the loss of the first
micro-batch: Llama 3.1 8B at fsdp 8 with one micro-batch of 2) holds none of them
(pipeckpt/memory/rank_peak.py, ``_at``; docs/MEMORY.md, the 8B row beside torchtitan's)."""

from typing import List, Tuple

import torch
from support.fake_world import fake_world
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from pipeckpt.app.models.llama import llama_config, llama_layers
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import profile
from pipeckpt.memory.rank_peak import _at, before_gradients
from pipeckpt.memory.sharding import Layout, rank_state, shard_numel
from pipeckpt.stages.partition import plan


class _Made(TorchDispatchMode):
    """(phase, dtype, elements) of every tensor an op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.made: List[Tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.made.append((self.phase, t.dtype, t.untyped_storage().nbytes() // t.element_size()))
        return out


def test_fsdp2_makes_a_units_reduce_scatter_input_in_its_backward_not_before() -> None:
    # Measured on a one-process fake world of 2 (collectives do nothing; every buffer is real).
    torch.manual_seed(0)
    layers = llama_layers(llama_config("tiny", seq_len=16))
    # A unit's fp32 reduce-scatter input holds its whole gradient, padded as its shards are.
    units = {sum(shard_numel(p.shape, 2) * 2 for p in layer.parameters()) for layer in layers}
    made = _Made()
    with fake_world(2) as mesh:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        fully_shard(layers, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        with made:
            loss = layers(torch.randint(256, (2, 16))).float().logsumexp(-1).mean()
            made.phase = "backward"
            loss.backward()
    before = {n for p, dtype, n in made.made if p == "forward" and dtype == torch.float32}
    after = {n for p, dtype, n in made.made if p == "backward" and dtype == torch.float32}
    assert not units & before  # no unit's reduce-scatter input through the forward and the loss
    assert units & after  # and its backward makes them (the check sees them where they are)


def test_a_peak_before_any_gradient_counts_no_collective_buffers() -> None:
    torch.manual_seed(0)
    layers = llama_layers(llama_config("tiny", seq_len=16))
    fitted = profile(layers, torch.randint(256, (2, 16)), fake=True)
    p = plan(layers, devices=["cpu"], stages=1, checkpoint="selective", chunks=1)
    stage = predict(fitted, p, chunks=1, optimizer="adamw", schedule="gpipe").stages[0]
    state = rank_state(
        list(layers), Layout(fsdp=8, reshard_after_forward=True, precision="bf16-mixed"), "adamw"
    )
    assert state.collectives > 0
    rest = stage.peak - stage.params - stage.grads - stage.optimizer
    for at in ("F0 layer 2", "F0 loss", "B0 loss", "gather"):
        rank = _at(stage, state, (0, 0, 0, 0, at), rest)
        assert rank.state.collectives == 0, at
        gathered = 0 if at.endswith(" loss") else state.unsharded  # at the loss every unit is resharded
        assert rank.peak == rest + state.params + state.optimizer + gathered, at
    # In a backward past the loss a unit's gradient may be made (the head's, before the layers'),
    # and where gradients are held (an earlier micro-batch's backward) so may its buffers.
    for at, grads in (("B0 layer 2", 0), ("B0 recompute layer 3", 0), ("B0 outside", 0), ("F1 loss", 1)):
        assert not before_gradients(at) or grads
        rank = _at(stage, state, (grads, 0, 0, 0, at), rest)
        assert rank.state.collectives == state.collectives, at
