"""``cluster=local``: this machine described by a short measurement, cached per host and torch version.

Why measured: a CPU's matmul rate, its memory bandwidth and gloo's cost between two local processes
have no datasheet, and a shared machine's figures are its own. The measurement takes a few seconds
(one torch thread, as the app runs each process: ``threads: 1`` in conf/train.yaml), so it is made
once and kept in the user's cache directory; delete the file to measure again.
"""

import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

__all__ = ["cache_file", "measure", "measured"]

_MATMUL = 512  # float32 matmul side: large enough to run at the core's rate, fast enough to repeat
_BANDWIDTH_BYTES = 8 * 2**20  # all-reduce size for gloo's bandwidth (latency is a 1-element all-reduce)


def cache_file() -> Path:
    """Where the measurement is kept: ``$XDG_CACHE_HOME`` (else ``~/.cache``)/pipeckpt, by host
    and torch version."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipeckpt"
    host = platform.node() or "host"
    return root / f"cluster-local-{host}-torch{torch.__version__}.json"


def measured() -> Dict[str, Any]:
    """The machine's figures (:func:`measure`'s), from the cache file when it holds them, else
    measured now and written there."""
    path = cache_file()
    try:
        m: Dict[str, Any] = json.loads(path.read_text())
        if not set(_FIGURES) <= set(m):
            raise ValueError(f"{path} predates {sorted(set(_FIGURES) - set(m))}")  # measured again
    except (OSError, ValueError):
        m = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(m, indent=1))
    m["file"] = str(path)
    return m


#: The figures a measurement holds (an older cache file without one of them is measured again).
_FIGURES = (
    "cores",
    "memory_bytes",
    "matmul_flops",
    "memory_bytes_per_s",
    "gloo_latency_s",
    "gloo_bytes_per_s",
    "gloo_all_gather_factor",
    "gloo_reduce_scatter_factor",
    "memory_is_adamw",
)


def measure() -> Dict[str, Any]:
    """The machine's figures: float32 matmul FLOP/s on one thread, the memory bandwidth AdamW's step
    reaches on it (``memory_bytes_per_s``: the optimizer term's rate), and gloo's
    all-reduce bandwidth and latency between 2 local processes (medians), with its all-gather's and
    reduce-scatter's time over the ring rule at that bandwidth (gloo runs both slower than its
    all-reduce, where NCCL's ring runs all three at one bus bandwidth)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops = _matmul_flops()
        optimizer = _optimizer_bytes_per_s()
    finally:
        torch.set_num_threads(threads)
    latency, bandwidth, gather, scatter = _gloo()
    return {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": _cpu_name(),
        "cores": os.cpu_count() or 1,
        "memory_bytes": _memory_bytes(),
        "matmul_flops": flops,
        "memory_bytes_per_s": optimizer,
        "gloo_latency_s": latency,
        "gloo_bytes_per_s": bandwidth,
        "gloo_all_gather_factor": gather,
        "gloo_reduce_scatter_factor": scatter,
        "memory_is_adamw": True,  # memory_bytes_per_s is AdamW's step (older caches: a plain copy)
        "torch": torch.__version__,
    }


def _matmul_flops(rounds: int = 7) -> float:
    a, b = torch.randn(_MATMUL, _MATMUL), torch.randn(_MATMUL, _MATMUL)
    a @ b  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * _MATMUL**3 / min(times)  # the fastest: the rate the core reaches when not preempted


def _optimizer_bytes_per_s(rounds: int = 5) -> float:
    """The memory bandwidth AdamW's step reaches, in the cost model's count of its traffic
    (:data:`~pipeckpt.layout.model_costs.ADAMW_ELEMENTS_PER_PARAM` float32 elements a parameter): the rate
    the optimizer term divides by. On a GPU the step runs at the memory's datasheet rate; on a CPU's
    one thread its arithmetic keeps it well below a plain copy's (2.8x below on this project's machine)."""
    from pipeckpt.layout.model_costs import ADAMW_ELEMENTS_PER_PARAM

    params = [torch.nn.Parameter(torch.randn(2**18)) for _ in range(16)]  # 4M float32, 16 tensors
    for q in params:
        q.grad = torch.randn_like(q)
    adamw = torch.optim.AdamW(params)
    adamw.step()  # the state is made
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        adamw.step()
        times.append(time.perf_counter() - t0)
    return sum(q.numel() for q in params) * ADAMW_ELEMENTS_PER_PARAM * 4 / min(times)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def _gloo() -> Tuple[float, float, float, float]:
    """Median latency (1-element all-reduce) and bandwidth (a ring all-reduce of 2 moves the whole
    buffer once each way: seconds = latency + bytes / bandwidth) between 2 spawned processes, and the
    all-gather's and reduce-scatter's seconds (of the same buffer, whole as the result or the input)
    over the ring rule's ``latency + bytes / 2 / bandwidth``."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result: List[float] = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=60)
    latency, big, gathered, scattered = result
    bandwidth = _BANDWIDTH_BYTES / max(big - latency, 1e-9)
    ring = _BANDWIDTH_BYTES / 2 / bandwidth  # (n - 1) / n of the buffer through each link, n = 2
    return latency, bandwidth, max(1.0, (gathered - latency) / ring), max(1.0, (scattered - latency) / ring)


def _worker(rank: int, port: int, queue: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        small, big = torch.ones(1), torch.ones(_BANDWIDTH_BYTES // 4)
        half = torch.ones(_BANDWIDTH_BYTES // 8)
        lat = _timed(lambda: dist.all_reduce(small), 30)
        bw = _timed(lambda: dist.all_reduce(big), 7)
        gathered = _timed(lambda: dist.all_gather_single(big, half), 7)
        scattered = _timed(lambda: dist.reduce_scatter_single(half, big), 7)
        if rank == 0:
            queue.put([lat, bw, gathered, scattered])
    finally:
        dist.destroy_process_group()


def _timed(fn: Any, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
