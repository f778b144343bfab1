"""pipeckpt._compat.torch_distributed: each reach into torch.distributed's pipelining stage, FSDP2,
DeviceMesh and DTensor checked by name and behaviour against the installed torch (split from
tests/test_compat.py as the module was split from torch_private.py)."""

import inspect
import re

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from pipeckpt import _compat


def test_pipeline_stage_runs_micro_batches_through_forward_one_chunk():
    method = getattr(PipelineStage, _compat.FORWARD_ONE_CHUNK)
    assert list(inspect.signature(method).parameters)[:5] == [
        "self",
        "fwd_chunk_id",
        "args",
        "kwargs",
        "save_forward_output",
    ]


def test_pipeline_stage_runs_local_backward_through_its_one_chunk_methods():
    for name in _compat.BACKWARD_ONE_CHUNK:
        params = list(inspect.signature(getattr(PipelineStage, name)).parameters)
        assert params[:2] == ["self", "bwd_chunk_id"], (name, params)


def test_pipeline_stage_sends_the_input_gradients_waiting_in_bwd_cache_from_get_bwd_send_ops():
    method, cache = _compat.BWD_SEND
    send = getattr(PipelineStage, method)
    assert list(inspect.signature(send).parameters) == ["self", "bwd_chunk_id"]
    assert f"self.{cache}.pop(bwd_chunk_id)" in inspect.getsource(send)


@pytest.mark.skipif(not _compat.STAGE_META_HOOKS, reason="this torch infers shapes in one method")
def test_pipeline_stage_passes_shape_metadata_through_send_and_recv_meta():
    send, recv = (list(inspect.signature(getattr(PipelineStage, n)).parameters) for n in _compat.STAGE_META)
    assert send == ["self", "meta", "dst_stage"]
    assert recv == ["self", "src_stage"]


def test_schedule_op_order_reads_torchs_schedule_ir():
    from torch.distributed.pipelining.schedules import ScheduleGPipe

    order = _compat.schedule_op_order(ScheduleGPipe, stages=2, microbatches=2)
    assert order == {r: [("F", 0), ("F", 1), ("B", 0), ("B", 1)] for r in range(2)}


def test_live_op_order_reads_a_looped_schedules_pipeline_order():
    import torch.distributed as dist
    from torch.distributed.pipelining.schedules import ScheduleLoopedBFS

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stages = [PipelineStage(nn.Linear(2, 2), j, 2, torch.device("cpu")) for j in range(2)]
        order = _compat.live_op_order(ScheduleLoopedBFS(stages, n_microbatches=2))
    finally:
        dist.destroy_process_group()
    assert order == [
        (0, "F", 0),
        (0, "F", 1),
        (1, "F", 0),
        (1, "F", 1),
        (1, "B", 1),
        (1, "B", 0),
        (0, "B", 1),
        (0, "B", 0),
    ]


def test_split_mesh_dim_views_a_mesh_dimension_as_replicate_by_shard_groups_of_its_ranks():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)  # no peers needed
    try:
        mesh = init_device_mesh("cpu", (4, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
        hybrid = _compat.split_mesh_dim(mesh["dp"], (2, 2), ("dp_replicate", "dp_shard"))
        assert mesh["dp"].mesh.tolist() == [1, 5, 9, 13]  # rank 5: replica 1 at pp 0, tp 1
        assert hybrid.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert hybrid.mesh.tolist() == [[1, 5], [9, 13]]
        assert dist.get_process_group_ranks(hybrid.get_group("dp_shard")) == [1, 5]
        assert dist.get_process_group_ranks(hybrid.get_group("dp_replicate")) == [5, 13]
        assert mesh.mesh_dim_names == ("dp", "pp", "tp")  # the mesh itself is unchanged
    finally:
        dist.destroy_process_group()


def test_local_extent_is_the_shape_and_offset_of_this_ranks_slice_of_a_dtensor():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)  # no peers needed
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # rank 3: dp 1, tp 1

        def extent(shape, placements, local):  # a DTensor made from this rank's local tensor alone
            t = DTensor.from_local(torch.empty(local), mesh, placements, run_check=False,
                                   shape=torch.Size(shape), stride=torch.empty(shape).stride())  # fmt: skip
            return _compat.local_extent(t)

        assert extent((8, 6), [Shard(0), Shard(1)], (4, 3)) == ((4, 3), (4, 3))
        assert extent((7, 6), [Shard(0), Replicate()], (3, 6)) == ((3, 6), (4, 0))  # uneven: 4 rows, 3
        assert extent((8, 6), [Replicate(), Replicate()], (8, 6)) == ((8, 6), (0, 0))
    finally:
        dist.destroy_process_group()


def test_pipeline_stage_turns_fsdp2s_sync_off_in_backward_through_the_three_setters_held():
    # reducing_in_backward holds these three at True; a fourth would escape it.
    method, setters = _compat.NOSYNC_BACKWARD
    source = inspect.getsource(getattr(PipelineStage, method))
    fsdp_branch = source[source.index("FSDPModule") :]
    called = set(re.findall(r"self\.submod\.(set_\w+)\(False\)", fsdp_branch))
    assert called == set(setters)
