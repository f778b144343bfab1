"""Rank 0 of a world of several ranks in this one process (torch's ``fake`` process group): a
collective returns at once, so what FSDP2 or tensor parallelism leaves on a rank can be built and
counted without starting the other ranks."""

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = ["fake_world"]


@contextmanager
def fake_world(size: int) -> Iterator[DeviceMesh]:
    """Rank 0 of ``size`` ranks in this process, with a one-dimensional mesh over them; the group is
    destroyed after the block."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,))
    finally:
        dist.destroy_process_group()
