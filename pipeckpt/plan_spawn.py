"""A measurement's own gloo world (:mod:`pipeckpt.plan_tp_host`, :mod:`pipeckpt.plan_fsdp_host`):
its processes spawned, rank 0's figures handed back through a file, and every process ending.

Why the figures are handed back before anyone leaves, and kept when a process dies after that: a
CI run (2026-12-06, a fresh clone of 34f7833, two pytest workers) lost a whole search when one of
the two processes timing a tensor-parallel split ended by SIGABRT with no Python error. Where in
its run is not known: the log kept no more. An abort without a Python error at a process's end is
what gloo's threads gave once on a benchmark's rank (``engines/distributed/kept_groups.py``), and
twelve runs of the same measurement here (five of the test, seven of the timing alone, most beside
a CPU-bound process) did not repeat it. So every process meets at a barrier before any tears its
group down, and rank 0's figures, written before it, are renamed into place after it: a process
that dies once they are there took nothing from them, and they are kept with a warning that names
the signal. A process that dies earlier, or raises, fails the measurement with its own error.
"""

import json
import os
import tempfile
import warnings
from typing import Any, Callable, Sequence

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException

__all__ = ["handed_back", "spawned"]


def spawned(worker: Callable[..., None], args: Sequence[Any], nprocs: int) -> Any:
    """What rank 0 of ``nprocs`` spawned processes running ``worker(rank, *args, scratch, out)``
    handed back (:func:`handed_back`); ``scratch`` is a folder of their own, removed after."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "figures.json")
        try:
            mp.start_processes(
                worker, args=(*args, scratch, out), nprocs=nprocs, join=True, start_method="spawn"
            )
        except ProcessExitedException as e:
            if e.signal_name is None or not os.path.exists(out):
                raise
            warnings.warn(
                f"a measuring process ended by {e.signal_name} after every process had its figures "
                f"handed back ({type(e).__name__}: {e}); the figures are kept",
                RuntimeWarning,
                stacklevel=2,
            )
        with open(out) as f:
            return json.load(f)


def handed_back(rank: int, out: str, figures: Any) -> None:
    """Every process waits for the others, so that none leaves (and tears its connections down)
    before all are done; then rank 0's ``figures`` are put at ``out``, written before and renamed
    into place after the wait: there only once every process got this far."""
    if rank == 0:
        with open(out + ".part", "w") as f:
            json.dump(figures, f)
    dist.barrier()
    if rank == 0:
        os.replace(out + ".part", out)
