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
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

_BEFORE, _AFTER = 1_000_003, 1_000_033  # bytes no tensor of the run has (prime)


def _freed_after(numel: int, calls: int, call: Callable[[], None]) -> Dict[str, int]:
    """Of ``calls`` calls, how many made a copy of ``numel`` float32 elements, and how many still
    held it at the allocation after the call."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as heard:
        for _ in range(calls):
            torch.empty(_BEFORE, dtype=torch.uint8)
            call()
            torch.empty(_AFTER, dtype=torch.uint8)
            torch.randn(512, 512) @ torch.randn(512, 512)
    results = heard.profiler.kineto_results  # type: ignore[union-attr]
    sizes: List[int] = [
        b for _, b in sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    ]
    copy, held, made, late, inside = numel * 4, 0, 0, 0, False
    for nbytes in sizes:
        if nbytes == -_BEFORE:
            inside = True
        elif nbytes == _AFTER:
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
