"""One rank's memory under FSDP2 and tensor parallelism (pipeckpt/memory/sharding.py), checked
against torch's own ``fully_shard`` and ``parallelize_module`` on a one-process fake world (torch's
``fake`` process group: collectives do nothing, every tensor a rank holds is real)."""

from typing import Dict, Iterator

import pytest
import torch
from support.fake_world import fake_world
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.models.llama import llama_config, llama_layers
from pipeckpt.memory.sharding import Layout, RankState, rank_state, shard_numel


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage_bytes(tensors: Iterator[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (FSDP2's gradients are views of one buffer)."""
    storages: Dict[int, int] = {}
    for t in tensors:
        st = _local(t).untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def test_shard_numel_pads_every_shard_to_the_first_chunks_rows() -> None:
    assert [shard_numel((64, 8), d) for d in (1, 2, 3, 64, 100)] == [512, 256, 22 * 8, 8, 8]
    assert shard_numel((), 4) == 1


def test_rank_state_equals_the_bytes_fsdp2_holds_on_rank_0_under_bf16_mixed() -> None:
    # Dimension 0 of most parameters (64, 32, 128, 256 rows) does not divide by 3: shards are padded.
    torch.manual_seed(0)
    layers = llama_layers(llama_config("tiny", seq_len=16))
    predicted = rank_state(list(layers), Layout(fsdp=3, precision="bf16-mixed"), "adamw")
    with fake_world(3) as mesh:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        fully_shard(layers, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        params = _storage_bytes(layers.parameters())
        out = layers(torch.randint(256, (2, 16)))
        unsharded = _storage_bytes(layers.parameters())  # the gathered bf16 parameters, held
        out.float().sum().backward()
        grads = _storage_bytes(p.grad for p in layers.parameters())
        optimizer = torch.optim.AdamW(layers.parameters())
        optimizer.step()
        state = _storage_bytes(v for s in optimizer.state.values() for v in s.values())
    measured = (params, grads, state, unsharded)
    assert measured == (predicted.params, predicted.grads, predicted.optimizer, predicted.unsharded)


def test_without_sharding_a_rank_holds_the_stage_whole_in_the_master_dtype() -> None:
    layers = llama_layers(llama_config("tiny", seq_len=16))
    numel = sum(p.numel() for p in layers.parameters())
    tensors = len(list(layers.parameters()))
    state = rank_state(list(layers), Layout(precision="bf16-mixed"), "adamw")
    assert state == RankState(4 * numel, 4 * numel, 8 * numel + 4 * tensors, 0, 0)


def test_a_stage_built_in_the_compute_dtype_is_counted_on_its_rank_as_one_built_in_the_master() -> None:
    # A planner builds a bf16-mixed model in bf16 (its fake builds); the walk then counts bf16
    # parameters and state, which on_rank must take off as such before adding the rank's fp32 share:
    # the rank's peak is the same as for the model built in fp32 (it was under by the bf16 whole).
    from pipeckpt.memory.predict import predict
    from pipeckpt.memory.profile import profile
    from pipeckpt.memory.rank_peak import on_rank
    from pipeckpt.memory.sharding import stage_rank_states
    from pipeckpt.stages.partition import plan

    layout = Layout(fsdp=4, precision="bf16-mixed")
    peaks = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        layers = llama_layers(llama_config("tiny", seq_len=16)).to(dtype)
        fitted = profile(layers, torch.randint(256, (2, 16)), fake=True)
        p = plan(layers, devices=["cpu"], stages=1, checkpoint="never", chunks=1)
        stage = predict(fitted, p, chunks=1, optimizer="adamw", schedule="gpipe").stages[0]
        mine, whole = stage_rank_states(layers, layout, "adamw")((len(layers),))[0]
        ranked = on_rank(stage, mine, whole)
        assert (ranked.params, ranked.optimizer) == (mine.params + mine.unsharded, mine.optimizer)
        peaks.append(ranked.peak - ranked.activations - ranked.working - ranked.boundary)
    assert peaks[0] == peaks[1]  # the state part of the peak, whatever the build's dtype


def test_reshard_after_forward_holds_the_running_and_the_prefetched_block_only() -> None:
    layers = list(llama_layers(llama_config("tiny", seq_len=16)))
    largest = max(sum(shard_numel(p.shape, 2) * 2 for p in layer.parameters()) for layer in layers)
    state = rank_state(layers, Layout(fsdp=2, reshard_after_forward=True, precision="bf16-mixed"))
    assert state.unsharded == 2 * largest * 2  # two blocks, bf16


def _saved_bytes(block: nn.Module, x: Tensor) -> int:
    """Bytes of the distinct storages ``block``'s forward saves for backward, parameters and buffers
    aside (a DTensor counted by its local shard)."""
    saved: Dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        st = _local(t).untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    owned = {_local(t).untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers()]}
    return sum(n for ptr, n in saved.items() if ptr not in owned)


def test_a_tensor_parallel_ranks_block_saves_what_the_block_narrowed_by_tp_saves() -> None:
    # Megatron-style TP without sequence parallelism: q, k, v, gate, up column-wise; o, down row-wise.
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, requires_grad=True)
    narrow = llama_layers(llama_config("tiny", seq_len=16, tensor_parallel=2))[1]
    expected = _saved_bytes(narrow, x)
    with fake_world(2) as mesh:
        block = llama_layers(llama_config("tiny", seq_len=16))[1]
        plan = {f"layer.self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}
        plan.update({"layer.mlp.gate_proj": ColwiseParallel(), "layer.mlp.up_proj": ColwiseParallel()})
        plan.update({"layer.self_attn.o_proj": RowwiseParallel(), "layer.mlp.down_proj": RowwiseParallel()})
        parallelize_module(block, mesh, plan)
        assert _saved_bytes(block, x) == expected


def test_a_tensor_parallel_degree_that_does_not_divide_the_heads_is_refused() -> None:
    with pytest.raises(PipeckptConfigError, match=r"tensor_parallel=3 for Llama tiny.*heads \(4\)"):
        llama_config("tiny", seq_len=16, tensor_parallel=3)
