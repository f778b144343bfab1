"""How often gloo frees its staging copy after its collective has returned: the figure behind
the memory model's ``Layout.gloo`` (pipeckpt/memory/sharding.py; docs/MEMORY.md, "On gloo").

gloo's ``reduce_scatter_tensor`` copies its input into a buffer of the same bytes, and
``all_gather_into_tensor`` its output (no torch operator makes either, so no profile sees them).
Two gloo processes of one torch thread run ``--calls`` synchronous calls of each, as FSDP2 makes
them, under torch's profiler with ``profile_memory``, each call followed by a sentinel allocation
and a 512 x 512 matmul (the next op's work). A call whose copy (an allocation of the buffer's bytes
made inside it) is still held at its sentinel was freed after it returned: the ops after it hold it.

Command::

    python benchmarks/bench_gloo_staging.py --calls 30    # a few seconds on 2 cores
"""

import argparse
import os
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness.allocated_bytes import SENTINELS, AllocatedBytes


def _freed_after(numel: int, calls: int, call: Callable[[], None]) -> Dict[str, int]:
    """Of ``calls`` calls, how many made a copy of ``numel`` float32 elements, and how many still
    held it at the allocation after the call (each call between the harness's two sentinels)."""
    with AllocatedBytes() as heard:
        for _ in range(calls):
            AllocatedBytes.mark(0)
            call()
            AllocatedBytes.mark(1)
            torch.randn(512, 512) @ torch.randn(512, 512)
    copy, held, made, late, inside = numel * 4, 0, 0, 0, False
    for _, nbytes in heard.events():
        if nbytes == -SENTINELS[0]:
            inside = True
        elif nbytes == SENTINELS[1]:
            late += held > 0
            inside = False
        elif nbytes == copy:
            held += 1
            made += inside
        elif nbytes == -copy:
            held -= 1
    return {"made": made, "freed_after": late}


def _rank(rank: int, port: int, numel: int, calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    whole, shard = torch.ones(numel), torch.empty(numel // 2)
    dist.reduce_scatter_tensor(shard, whole)  # the group's own buffers made before counting
    dist.all_gather_into_tensor(whole, shard)
    scatter = _freed_after(numel, calls, lambda: dist.reduce_scatter_tensor(shard, whole))
    gather = _freed_after(numel, calls, lambda: dist.all_gather_into_tensor(whole, shard))
    if rank == 0:
        mib = numel * 4 / 2**20
        print(f"| collective | calls | {mib:.0f} MiB copies made | freed after the call returned |")
        print("|---|---|---|---|")
        for name, seen in (("reduce_scatter_tensor", scatter), ("all_gather_into_tensor", gather)):
            print(f"| {name} | {calls} | {seen['made']} | {seen['freed_after']} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--numel", type=int, default=2**20, help="float32 elements of the whole buffer")
    parser.add_argument("--port", type=int, default=29537)
    args = parser.parse_args()
    mp.spawn(_rank, args=(args.port, args.numel, args.calls), nprocs=2)


if __name__ == "__main__":
    main()
