"""Figures of a ``cluster=local`` calibration, for tests that search on ``local`` without measuring
this machine (``monkeypatch.setattr(calibrate, "measured", lambda: dict(FIGURES))``): round rates
that make every figure the cost model reads easy to follow."""

from typing import Any, Dict, List

FIGURES: Dict[str, Any] = {
    "when": "now",
    "cpu": "test",
    "cores": 2,
    "memory_bytes": 8 * 2**30,
    "matmul_flops": 100e9,
    "memory_bytes_per_s": 5e9,
    "gloo_latency_s": 1e-4,
    "gloo_bytes_per_s": 1e9,
    "gloo_all_gather_factor": 2.0,
    "gloo_reduce_scatter_factor": 3.5,
    "memory_is_adamw": True,
    "file": "test",
}


def priced_costs(monkeypatch: Any) -> List[Any]:
    """Searches on ``local`` with :data:`FIGURES` for its calibration from now on; returns the list
    that each layout's :class:`~pipeckpt.layout.model_costs.ModelCosts` is appended to as the cost
    model prices it."""
    from pipeckpt.layout import calibrate, cost

    monkeypatch.setattr(calibrate, "measured", lambda: dict(FIGURES))
    seen: List[Any] = []
    real = cost.estimate

    def estimate(c: Any, costs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(costs)
        return real(c, costs, *args, **kwargs)

    monkeypatch.setattr(cost, "estimate", estimate)
    return seen
