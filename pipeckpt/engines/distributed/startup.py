"""Every process of a run waits for the others to start, within a window of its own.

Why: torch's rendezvous waits for the processes with the time limit of every later collective (the
strategy's ``timeout``, 60 s by default), so one rank that starts late (a loaded node, slow imports,
a slow file system) failed the whole run with torch's ``DistStoreError`` and no name. Here the
rendezvous store is made first, with the start-up window ``start_timeout``; each process announces
itself in it and waits for all the others; the process group is then made on that store with the
step ``timeout``. A rank that is still missing when the window closes is named by every rank that
waited for it.

The same store carries what global rank 0 decides before any process group exists
(:func:`from_rank_zero`): under a launcher outside Lightning (torchrun, srun) every process runs the
script itself, and a choice that measures this machine (``strategy.layout=auto`` on
``cluster=local``) could differ between them, so one process makes it and hands it on.
"""

import contextlib
import json
import os
import time
from datetime import timedelta
from typing import Callable, List, Optional

import torch.distributed as dist
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from pipeckpt._errors import PipeckptConfigError

__all__: List[str] = []

_PREFIX = "pipeckpt/started/"
_HANDED = "pipeckpt/handed/"
#: How long rank 0, its own work failed, waits for the others to read its error before raising it.
_TELLING_S = 60.0
#: The least the others wait for rank 0's work once they reach its store (the start-up window if
#: longer): the largest published layout search, Megatron's 145.6B GPT on 1,536 A100, took 709 s on
#: this project's 2-core machine. A rank 0 that stops is seen at once (its store closes with it, or
#: torchrun's agent stops the job), so only a rank 0 that hangs is waited for this long.
_WORK_S = 3600.0
#: Rank 0's store of :func:`from_rank_zero`, kept for the process's life: the rendezvous's store joins
#: its server (``multi_tenant``) rather than opening the main port a second time.
_KEPT: List[dist.Store] = []


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
    begun = time.monotonic()
    store = _store(environment, rank=rank, world_size=world_size, window_s=window_s, describe=describe)
    keys = [f"{_PREFIX}{_attempt()}/{other}" for other in range(world_size)]
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
            where=_where(environment),
            why=str(error),
        ) from None
    return store


def outside_launcher(*, devices: int, num_nodes: int) -> Optional[ClusterEnvironment]:
    """The cluster environment of a run of ``devices`` processes on each of ``num_nodes`` nodes that a
    launcher outside Lightning started (torchrun, srun, LSF, MPI, or by hand with ``LOCAL_RANK`` set),
    each running the script itself; None under Lightning's own launcher or alone. The order is
    Lightning's own (``_AcceleratorConnector._choose_and_init_cluster_environment``), so this is the
    environment the Trainer will pick; a launch by hand gets its ranks as the strategy sets them."""
    for kind in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment):
        if kind.detect():
            environment: ClusterEnvironment = kind()
            break
    else:
        environment = LightningEnvironment()
        if not environment.creates_processes_externally:
            return None  # Lightning's launcher starts the processes (and hands them the pick)
        environment.set_world_size(devices * num_nodes)
        environment.set_global_rank(environment.node_rank() * devices + environment.local_rank())
    return environment if environment.world_size() > 1 else None


def from_rank_zero(
    environment: ClusterEnvironment, name: str, compute: Callable[[], str], *, window_s: float, what: str
) -> str:
    """``compute()``'s text, run by global rank 0 alone and handed to every process of the run through
    the run's store, before any process group. The others reach the store within ``window_s`` (the
    start-up window), then wait for rank 0's work up to the longer of that and :data:`_WORK_S`; an
    error of rank 0's ``compute`` reaches each of them as its own message, naming ``what`` failed,
    and a rank 0 that stops is reported at once."""
    rank, world_size = environment.global_rank(), environment.world_size()
    describe = lambda other: f"rank {other}"  # noqa: E731
    store = _store(environment, rank=rank, world_size=world_size, window_s=window_s, describe=describe)
    key = f"{_HANDED}{_attempt()}/{name}"
    if rank == 0:
        _KEPT.append(store)
        try:
            text = compute()
        except BaseException as error:
            store.set(key, json.dumps({"error": f"{type(error).__name__}: {error}"}))
            _read_by_all(store, key, world_size, min(window_s, _TELLING_S))
            raise
        store.set(key, json.dumps({"text": text}))
        _read_by_all(store, key, world_size, window_s)
        return text
    wait_s = max(window_s, _WORK_S)
    begun = time.monotonic()
    try:
        store.set_timeout(timedelta(seconds=wait_s))
        handed = json.loads(store.get(key))  # one request: waits for the key (the store's timeout)
        store.set(f"{key}/read/{rank}", "1")
    except (RuntimeError, dist.DistError) as error:  # rank 0 stopped (its store with it), or hangs
        raise StartupError(
            f"pipeckpt: rank {rank} waited {time.monotonic() - begun:.0f}s for {what} on rank 0, which "
            f"did not hand it on (the run's store at {_where(environment)}: {_first_line(str(error))}). "
            f"HINT: look at the output of rank 0: did it stop? Work that takes longer than {wait_s:g}s "
            "needs a longer `start_timeout` on the strategy"
        ) from None
    if "error" in handed:
        raise PipeckptConfigError(  # rank 0's own words last, its fix with them
            f"pipeckpt: rank {rank} stops because {what} failed on rank 0 (its output has the "
            f"traceback): {handed['error']}"
        )
    return str(handed["text"])


def _store(
    environment: ClusterEnvironment,
    *,
    rank: int,
    world_size: int,
    window_s: float,
    describe: Callable[[int], str],
) -> dist.Store:
    """A store at the run's main address and port: hosted by rank 0 (its server shared by every store of
    the process, ``multi_tenant``), or by torchrun's agent, whose client every rank is, as in torch's
    own rendezvous."""
    host, port = environment.main_address, int(environment.main_port)
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            hosts,
            timeout=timedelta(seconds=window_s),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except (RuntimeError, dist.DistError) as error:  # rank 0 never opened the store, or closed it
        raise _missing(
            [0], me=rank, window_s=window_s, describe=describe, where=_where(environment), why=str(error)
        ) from None


def _read_by_all(store: dist.Store, key: str, world_size: int, window_s: float) -> None:
    """Rank 0 waits until every other rank has read ``key`` (up to ``window_s``), as its store, which
    the others read it from, closes when it exits (a rank whose first try to connect came before the
    store was up retries after a back-off of up to about 40 s); a rank missing at the end is left to
    the rendezvous to name."""
    reads = [f"{key}/read/{other}" for other in range(1, world_size)]
    with contextlib.suppress(RuntimeError, dist.DistError):
        store.wait(reads, timedelta(seconds=window_s))


def _attempt() -> str:
    """The launcher's attempt: torchrun's agent store outlives a restart, so keys carry it."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _first_line(why: str) -> str:
    """An error's first line: torch's store errors go on with a C++ backtrace."""
    return why.strip().splitlines()[0] if why.strip() else "no answer"


def _where(environment: ClusterEnvironment) -> str:
    return f"{environment.main_address}:{environment.main_port}"


def _missing(
    missing: List[int], *, me: int, window_s: float, describe: Callable[[int], str], where: str, why: str
) -> StartupError:
    names = "; ".join(describe(other) for other in missing)
    return StartupError(
        f"pipeckpt: {names} did not join the run within start_timeout={window_s:g}s, so rank {me} "
        f"stops (the rendezvous store at {where}, hosted by rank 0: {_first_line(why)}). HINT: look at the "
        f"output of rank {missing[0]}: did its process start (the launcher, the node), or is it slow "
        "to start (imports, a loaded node)? Raise the strategy's `start_timeout` for a slow start"
    )
