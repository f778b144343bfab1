"""Clusters: the presets load with their datasheet figures, a user's few lines load, a wrong field is
refused by its name, and ``local`` is measured once and then read from its cache."""

import json
from typing import Any, Dict

import pytest

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.layout import calibrate
from pipeckpt.layout.cluster import Cluster, cluster, from_mapping, presets


def user_spec() -> Dict[str, Any]:
    """A user's own cluster, in the few lines docs/LAYOUT.md shows."""
    return {
        "name": "lab",
        "nodes": 2,
        "devices_per_node": 4,
        "device": {
            "name": "L40S",
            "memory_bytes": 48 * 2**30,
            "peak_flops": {"bf16-mixed": 362e12, "32-true": 91.6e12},
            "memory_bytes_per_s": 864e9,
            "efficiency": 0.5,
        },
        "intra_node_bytes_per_s": 32e9,
        "inter_node_bytes_per_s": 12.5e9,
        "latency_s": 2e-5,
    }


@pytest.mark.parametrize("name", ["h100_8", "h100_8x8", "a100_8x8", "h200_1"])
def test_presets_load(name: str) -> None:
    c = cluster(name)
    assert isinstance(c, Cluster) and c.name == name
    assert c.world == c.nodes * c.devices_per_node
    assert 0 < c.device.efficiency <= 1
    # achieved = peak x efficiency, for every precision the preset lists
    for precision, peak in c.device.peak_flops.items():
        assert c.device.flops(precision) == pytest.approx(peak * c.device.efficiency)
    assert set(presets()) >= {"h100_8", "h100_8x8", "a100_8x8", "h200_1", "local"}


def test_preset_worlds() -> None:
    assert (cluster("h100_8").world, cluster("h100_8x8").world) == (8, 64)
    assert (cluster("a100_8x8").world, cluster("h200_1").world) == (64, 1)
    # devices: the cluster cut to as few nodes as hold them
    assert (cluster("h100_8x8", devices=4).nodes, cluster("h100_8x8", devices=4).devices_per_node) == (1, 4)
    assert cluster("h100_8x8", devices=16).nodes == 2


def test_user_mapping_loads() -> None:
    spec = user_spec()
    c = cluster(spec)
    assert c.world == spec["nodes"] * spec["devices_per_node"]
    assert c.device.flops("bf16-mixed") == pytest.approx(362e12 * 0.5)
    assert c.device.host_bytes_per_s == 0.0  # optional, absent: no host link
    assert cluster(c) is c


@pytest.mark.parametrize(
    "path, value, named",
    [
        (("nodes",), 0, "cluster.nodes"),
        (("devices_per_node",), 2.5, "cluster.devices_per_node"),
        (("latency_s",), -1, "cluster.latency_s"),
        (("inter_node_bytes_per_s",), "fast", "cluster.inter_node_bytes_per_s"),
        (("device", "efficiency"), 1.5, "cluster.device.efficiency"),
        (("device", "memory_bytes"), None, "cluster.device.memory_bytes"),
        (("device", "peak_flops"), {"fp8": 1e15}, "cluster.device.peak_flops.fp8"),
        (("device", "peak_flops"), {}, "cluster.device.peak_flops"),
        (("device", "name"), "", "cluster.device.name"),
        (("name",), None, "cluster.name"),
        (("nodez",), 1, "cluster.nodez"),
        (("device", "flops"), 1, "cluster.device.flops"),
    ],
)
def test_bad_fields_refused_by_name(path: Any, value: Any, named: str) -> None:
    spec = user_spec()
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(PipeckptConfigError, match=named.replace(".", r"\.")):
        from_mapping(spec)


def test_unknown_preset_and_precision_refused() -> None:
    with pytest.raises(PipeckptConfigError, match="h100_9"):
        cluster("h100_9")
    with pytest.raises(PipeckptConfigError, match="peak_flops"):
        cluster(user_spec()).device.flops("16-true")
    with pytest.raises(PipeckptConfigError, match="devices=16"):
        cluster("h100_8", devices=16)
    with pytest.raises(PipeckptConfigError, match="multiple of 8"):
        cluster("h100_8x8", devices=12)


def test_local_is_measured_once_then_cached(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {
        "when": "now",
        "cpu": "test",
        "cores": 2,
        "memory_bytes": 8 * 2**30,
        "matmul_flops": 100e9,
        "memory_bytes_per_s": 20e9,
        "gloo_latency_s": 1e-4,
        "gloo_bytes_per_s": 1e9,
        "gloo_all_gather_factor": 2.0,
        "gloo_reduce_scatter_factor": 3.5,
        "memory_is_adamw": True,
        "torch": "x",
    }
    calls = []

    def measure() -> Dict[str, Any]:
        calls.append(1)
        return dict(figures)

    monkeypatch.setattr(calibrate, "measure", measure)
    two = cluster("local")
    four = cluster("local", devices=4)
    assert len(calls) == 1  # the second read the cache
    assert calibrate.cache_file().is_relative_to(tmp_path)
    assert json.loads(calibrate.cache_file().read_text())["matmul_flops"] == figures["matmul_flops"]
    # each process runs at the one-thread rate while it has a core; 4 on 2 cores are bound by the cores
    assert two.device.flops("32-true") == four.device.flops("32-true") == pytest.approx(100e9)
    assert (two.cores, four.cores) == (2, 2)
    assert four.device.memory_bytes == 8 * 2**30 // 4
    assert (two.intra_node_bytes_per_s, two.latency_s, four.world) == (1e9, 1e-4, 4)
    assert (four.all_gather_factor, four.reduce_scatter_factor) == (2.0, 3.5)
    assert not two.overlaps and not four.overlaps  # 2 cores, no core free for gloo beside compute


def test_a_cache_file_without_a_newer_figure_is_measured_again(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calibrate.cache_file().parent.mkdir(parents=True)
    calibrate.cache_file().write_text(json.dumps({"cores": 2, "matmul_flops": 1.0}))  # an older layout
    figures = {k: 1.5 for k in calibrate._FIGURES}
    monkeypatch.setattr(calibrate, "measure", lambda: dict(figures, when="now", cpu="test"))
    assert cluster("local").reduce_scatter_factor == 1.5
    assert json.loads(calibrate.cache_file().read_text())["gloo_all_gather_factor"] == 1.5


def test_a_described_cluster_takes_collective_factors_and_defaults_them_to_the_ring_rule() -> None:
    spec = dict(user_spec(), all_gather_factor=1.25)
    assert (from_mapping(spec).all_gather_factor, from_mapping(spec).reduce_scatter_factor) == (1.25, 1.0)
    with pytest.raises(PipeckptConfigError, match=r"^cluster.reduce_scatter_factor=-1"):
        from_mapping(dict(user_spec(), reduce_scatter_factor=-1))
    assert from_mapping(user_spec()).overlaps and not from_mapping(dict(user_spec(), overlaps=False)).overlaps
    with pytest.raises(PipeckptConfigError, match=r"^cluster.overlaps='no'"):
        from_mapping(dict(user_spec(), overlaps="no"))


@pytest.mark.slow
def test_local_measurement_runs(tmp_path: Any, monkeypatch: Any) -> None:
    """The real measurement (2 gloo processes): every figure positive."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    c = cluster("local")
    assert c.device.flops("32-true") > 0 and c.device.memory_bytes_per_s > 0
    assert c.intra_node_bytes_per_s > 0 and c.latency_s > 0
    assert calibrate.cache_file().exists()
