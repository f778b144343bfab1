"""One layout of the app's model trained by the layout benchmark's harness on real gloo processes
(``bench_layout_measured.py``'s worker: one warm-up, one timed and one counted step), and each
pipeline rank's peak bytes in the counted step: every storage alive, a DTensor by its local shard,
torch's receive buffers included, another rank's parameters (left on the meta device) not; or, with
``allocated``, what the step began with and the most the CPU allocator held above that
(``harness.allocated_bytes``: inside DTensor's operators too)."""

from typing import Any, Dict, List, Sequence

from bench_layout_measured import overrides
from harness.ranks import run_ranks

from support.paths import REPO

__all__ = ["measured_peaks"]


def measured_peaks(
    case: Sequence[str], settings: Dict[str, Any], *, world: int, batch: int, allocated: bool = False
) -> List[int]:
    """Each pipeline rank's peak bytes (the most any of its replicas or tensor-parallel ranks held)
    for the layout ``settings`` (as the search hands a pick on) of the model ``case``; by the CPU
    allocator where ``allocated``."""
    pp = int(settings["stages"]) // int(settings.get("virtual_stages") or 1)  # pipeline ranks
    row = {
        "layout": "measured",
        "pick": {"settings": settings, "dp": settings["dp"], "row": "measured"},
        "pp": pp,
    }
    spec: Dict[str, object] = {
        "rows": [row],
        "rounds": 1,
        "overrides": overrides(case, world, batch),
        "warmup": 1,
        "timed": 1,
        "allocated": allocated,
    }
    results = run_ranks(str(REPO / "benchmarks" / "bench_layout_measured.py"), world, spec, timeout=1200)
    peaks = [0] * pp
    for r in results:
        peaks[r["pp_rank"]] = max(peaks[r["pp_rank"]], r["allocated" if allocated else "peak"])
    return peaks
