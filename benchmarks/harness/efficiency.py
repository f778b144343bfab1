"""A device preset's efficiency fitted to a figure: the published throughput of a run
(:mod:`bench_layout_published`) or a step measured on the device (:mod:`bench_gpu_calibrate`).

The cost model's compute is its FLOPs over ``peak x efficiency``, so its step falls as the efficiency
rises, and the efficiency that meets a figure is found by bisection; both fits share it.
"""

from dataclasses import replace
from typing import Callable

from pipeckpt.layout.cluster import Cluster


def with_efficiency(where: Cluster, efficiency: float) -> Cluster:
    """``where`` with its device's efficiency replaced."""
    return replace(where, device=replace(where.device, efficiency=efficiency))


def bisect_efficiency(too_slow: Callable[[float], bool], *, low: float, high: float = 1.0) -> float:
    """The efficiency in ``[low, high]`` where the prediction stops being slower than the figure:
    ``too_slow(efficiency)`` says whether the prediction at that efficiency is still slower."""
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if too_slow(mid) else (low, mid)
    return (low + high) / 2
