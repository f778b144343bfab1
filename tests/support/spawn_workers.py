"""Workers for tests/test_plan_spawn.py, spawned by :func:`pipeckpt.plan_spawn.spawned` (a spawned
process imports its function by module name, so they live in an importable module)."""

import os

import torch.distributed as dist

from pipeckpt.plan_spawn import handed_back


def _joined(rank: int, world: int, scratch: str) -> None:
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(scratch, "store"), world), rank=rank, world_size=world
    )


def hands_back_then_aborts(rank: int, world: int, scratch: str, out: str) -> None:
    """Rank 0 hands back ``{"rank": 0}``; rank 1 then aborts (SIGABRT), as gloo's threads once did."""
    _joined(rank, world, scratch)
    handed_back(rank, out, {"rank": rank})
    if rank == 1:
        os.abort()
    dist.destroy_process_group()


def aborts_before_handing_back(rank: int, world: int, scratch: str, out: str) -> None:
    """Rank 1 aborts before any figure is handed back."""
    _joined(rank, world, scratch)
    if rank == 1:
        os.abort()
    handed_back(rank, out, {"rank": rank})
    dist.destroy_process_group()


def raises(rank: int, world: int, scratch: str, out: str) -> None:
    """Rank 1 raises its own error."""
    if rank == 1:
        raise ValueError("rank 1's own error")
