"""What tensor parallelism costs a layer on the host, measured on this machine for ``cluster=local``.

Why: a layer that ``tensor_parallel_plan`` splits runs its split modules on DTensors, and every op on
one pays DTensor's dispatch (sharding propagation, the placement checks) on the host before its
kernel. On a CPU with small layers that dispatch is as long as the layer's own compute (an HF Llama
layer of hidden 256: about 15 ms more per forward and 27 ms per backward of 8 samples, measured
2026-12-02), where the cost model divided the compute by ``tp`` and counted only the all-reduces, so
every tensor-parallel layout was predicted the fastest and measured the slowest
(benchmarks/RESULTS_layout.md). It is measured rather than counted: the same model, built on real
tensors, is split by its own plan over a mesh of this one process (a world of one: the dispatch
without the collectives, which the model counts apart) and timed layer by layer beside the unsplit
one; the difference per layer is the host's share, which does not shrink with ``tp``.
"""

import contextlib
from typing import Iterator, Optional, Sequence, Tuple

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeckpt.engines.distributed.tensor_parallel import TensorParallel
from pipeckpt.memory.profile import ModelProfile

__all__ = ["one_process_mesh", "split", "tp_host_s"]


@contextlib.contextmanager
def one_process_mesh() -> Iterator[Optional[DeviceMesh]]:
    """A one-process gloo world's ``tp`` mesh, for as long as the block runs (its group destroyed
    after); None where this process is already in a process group (a run under torchrun or SLURM,
    whose processes each search alone): a second default group cannot be opened there, and the
    host's share is then left out, as before."""
    if dist.is_available() and dist.is_initialized():
        yield None
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))["tp"]
    finally:
        dist.destroy_process_group()


def split(layers: Sequence[nn.Module], plan: Sequence[Tuple[str, str]], mesh: DeviceMesh) -> None:
    """``layers`` split in place by ``plan`` over ``mesh``, as the distributed engine splits them."""
    TensorParallel(mesh, dict(plan)).split(list(layers))


def tp_host_s(whole: ModelProfile, split_profile: ModelProfile) -> Tuple[float, float]:
    """The host's seconds a split adds to one layer's forward and to its backward, per micro-batch:
    the mean over the layers of the split profile's time less the whole one's (each at least 0: a
    layer no plan entry names costs nothing more)."""
    pairs = list(zip(whole.layers, split_profile.layers, strict=True))
    forward = sum(max(0.0, s.forward_s - w.forward_s) for w, s in pairs) / len(pairs)
    backward = sum(max(0.0, s.backward_s - w.backward_s) for w, s in pairs) / len(pairs)
    return forward, backward
