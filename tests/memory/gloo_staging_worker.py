"""One rank of tests/memory/test_gloo_staging.py (started by tests/support/ranks.py): gloo's
``reduce_scatter_tensor``, FSDP2's call (``_fsdp_collectives.foreach_reduce``, synchronous), with
torch's profiler hearing every allocation of the CPU allocator; writes ``staging.rank<R>.json``:
the bytes of each allocation made inside the call and of the input."""

import json
import os
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from support.ranks import serve
from torch.profiler import ProfilerActivity, profile

# Bytes no tensor of the run has (prime), allocated just before and just after the call.
_BEFORE, _AFTER = 1_000_003, 1_000_033


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    numel = int(spec["numel"])
    grads = torch.ones(numel)  # a unit's whole gradient, as FSDP2 copies it in
    shard = torch.empty(numel // world)
    dist.reduce_scatter_tensor(shard, grads)  # once before: the group's own buffers are made
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as heard:
        torch.empty(_BEFORE, dtype=torch.uint8)
        dist.reduce_scatter_tensor(shard, grads)
        torch.empty(_AFTER, dtype=torch.uint8)
    results = heard.profiler.kineto_results  # type: ignore[union-attr]
    events = sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    sizes = [nbytes for _, nbytes in events]
    inside = sizes[sizes.index(-_BEFORE) + 1 : sizes.index(_AFTER)]
    made = [nbytes for nbytes in inside if nbytes > 0]
    seen = {"input": grads.nbytes, "made": made, "reduced": shard[0].item()}
    Path(out, f"staging.rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    serve(run)
