"""Figures of a ``cluster=local`` calibration, for tests that search on ``local`` without measuring
this machine (``monkeypatch.setattr(calibrate, "measured", lambda: dict(FIGURES))``): round rates
that make every figure the cost model reads easy to follow."""

from typing import Any, Dict

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
