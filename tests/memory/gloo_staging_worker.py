"""One rank of tests/memory/test_gloo_staging.py (started by tests/support/ranks.py): gloo's
``reduce_scatter_tensor``, FSDP2's call (``_fsdp_collectives.foreach_reduce``, synchronous), with
the benchmarks' CPU allocator count (harness.allocated_bytes) around it; writes ``staging.rank<R>.json``:
the bytes of each allocation made inside the call and of the input."""

import json
import os
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from harness.allocated_bytes import SENTINELS, AllocatedBytes  # the benchmarks' allocator count
from support.ranks import serve


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    numel = int(spec["numel"])
    grads = torch.ones(numel)  # a unit's whole gradient, as FSDP2 copies it in
    shard = torch.empty(numel // world)
    dist.reduce_scatter_tensor(shard, grads)  # once before: the group's own buffers are made
    with AllocatedBytes() as heard:
        AllocatedBytes.mark(0)
        dist.reduce_scatter_tensor(shard, grads)
        AllocatedBytes.mark(1)
    sizes = [nbytes for _, nbytes in heard.events()]
    inside = sizes[sizes.index(-SENTINELS[0]) + 1 : sizes.index(SENTINELS[1])]
    made = [nbytes for nbytes in inside if nbytes > 0]
    seen = {"input": grads.nbytes, "made": made, "reduced": shard[0].item()}
    Path(out, f"staging.rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    serve(run)
