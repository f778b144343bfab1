"""Every process of a run waits for the others to start, within a window of its own.

Why: torch's rendezvous waits for the processes with the time limit of every later collective (the
strategy's ``timeout``, 60 s by default), so one rank that starts late (a loaded node, slow imports,
a slow file system) failed the whole run with torch's ``DistStoreError`` and no name. Here the
rendezvous store is made first, with the start-up window ``start_timeout``; each process announces
itself in it and waits for all the others; the process group is then made on that store with the
step ``timeout``. A rank that is still missing when the window closes is named by every rank that
waited for it.
"""

import os
import time
from datetime import timedelta
from typing import Callable, List

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment

from pipeckpt._errors import PipeckptConfigError

__all__: List[str] = []

_PREFIX = "pipeckpt/started/"


class StartupError(PipeckptConfigError):
    """A rank of the run did not start within the start-up window."""


def rendezvous(
    environment: ClusterEnvironment,
    *,
    rank: int,
    world_size: int,
    window_s: float,
    describe: Callable[[int], str],
) -> dist.Store:
    """The run's store (hosted by rank 0) once every rank has joined it; raises :class:`StartupError`
    naming the ranks still missing after ``window_s`` seconds."""
    host, port = environment.main_address, int(environment.main_port)
    begun = time.monotonic()
    window = timedelta(seconds=window_s)
    # Under torchrun the agent hosts the store and every rank is its client, as in torch's own rendezvous.
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(
            host, port, world_size, hosts, timeout=window, wait_for_workers=False, multi_tenant=True
        )
    except (RuntimeError, dist.DistError) as error:  # rank 0 never opened the store, or closed it
        raise _missing(
            [0], me=rank, window_s=window_s, describe=describe, where=f"{host}:{port}", why=str(error)
        ) from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # an agent's store outlives a restart
    keys = [f"{_PREFIX}{attempt}/{other}" for other in range(world_size)]
    store.set(keys[rank], str(os.getpid()))
    left = max(0.001, window_s - (time.monotonic() - begun))
    try:
        store.wait(keys, timedelta(seconds=left))
    except (RuntimeError, dist.DistError) as error:
        try:
            missing = [other for other, key in enumerate(keys) if not store.check([key])]
        except (RuntimeError, dist.DistError):  # the store went with rank 0
            missing = [0]
        raise _missing(
            missing or [0],
            me=rank,
            window_s=window_s,
            describe=describe,
            where=f"{host}:{port}",
            why=str(error),
        ) from None
    return store


def _missing(
    missing: List[int], *, me: int, window_s: float, describe: Callable[[int], str], where: str, why: str
) -> StartupError:
    names = "; ".join(describe(other) for other in missing)
    first = why.strip().splitlines()[0] if why.strip() else "no answer"
    return StartupError(
        f"pipeckpt: {names} did not join the run within start_timeout={window_s:g}s, so rank {me} "
        f"stops (the rendezvous store at {where}, hosted by rank 0: {first}). HINT: look at the "
        f"output of rank {missing[0]}: did its process start (the launcher, the node), or is it slow "
        "to start (imports, a loaded node)? Raise the strategy's `start_timeout` for a slow start"
    )
