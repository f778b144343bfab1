"""A cluster as the cost model sees it: one kind of device, how many, and the links between them.

Why a description and not a probe: the layout is chosen before the allocation it runs on, often
from a laptop, so the machine is described by its published figures (conf/cluster/NAME.yaml, each
figure with its datasheet) or by a user's few lines. Only ``local``, this machine, is measured
(:mod:`pipeckpt.layout.calibrate`), once per host and torch version, and cached.
"""

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Set, Union

from pipeckpt._errors import config_error

__all__ = ["PRECISION_NAMES", "Device", "Cluster", "cluster", "presets", "from_mapping"]

#: Lightning's precision names a device's ``peak_flops`` may list (the compute dtype's rate).
PRECISION_NAMES = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")

CONF = Path(__file__).resolve().parents[2] / "conf" / "cluster"


@dataclass(frozen=True)
class Device:
    """One accelerator (or this machine's share of CPU, for ``local``).

    Args:
        name: what it is, e.g. ``"H100 SXM5 80GB"``.
        memory_bytes: memory one rank may fill.
        peak_flops: dense FLOP/s by Lightning precision name (the datasheet's dense, not sparse, rate
            of the compute dtype's matrix units).
        memory_bytes_per_s: the device memory's bandwidth (the optimizer step is bound by it).
        efficiency: achieved over peak for a training step's compute (see docs/LAYOUT.md: one
            constant per device kind, each with its source).
        host_bytes_per_s: device to host bandwidth, one direction (``offload`` moves stage inputs
            over it); 0 where there is no separate host (a CPU).
    """

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bytes_per_s: float
    efficiency: float
    host_bytes_per_s: float = 0.0

    def __hash__(self) -> int:  # peak_flops is a mapping: hashed by its items (the cost model caches)
        return hash((self.name, self.memory_bytes, tuple(sorted(self.peak_flops.items())), self.efficiency))

    def flops(self, precision: str) -> float:
        """The achieved FLOP/s in ``precision``: peak x efficiency."""
        if precision not in self.peak_flops:
            raise config_error(
                f"precision {precision!r} on {self.name}",
                f"cluster.device.peak_flops lists {sorted(self.peak_flops)}",
                "add the device's dense FLOP/s for that precision, or train in one listed",
            )
        return float(self.peak_flops[precision]) * self.efficiency


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices.

    Args:
        name: the preset's or the user's name.
        nodes: machines.
        devices_per_node: devices in each.
        device: the device.
        intra_node_bytes_per_s: one device's bandwidth to another in its node, one direction
            (NVLink's per-GPU figure / 2 for a bidirectional datasheet figure).
        inter_node_bytes_per_s: one device's share of its node's network, one direction.
        latency_s: the fixed cost of one collective or send (its small-message time).
        all_gather_factor, reduce_scatter_factor: the collective's time over the ring rule at the
            link's bandwidth (:mod:`pipeckpt.layout.links`); 1 for NCCL, whose ring runs all-reduce,
            all-gather and reduce-scatter at one bus bandwidth (nccl-tests), measured for gloo
            (``local``), which runs the two slower than its all-reduce.
        cores: the processors the devices share, where they share them (a CPU machine running more
            processes than it has cores: the busy processes share them, moment by moment,
            :mod:`pipeckpt.layout.shared_cores`); 0: each device its own.
        overlaps: whether communication runs beside compute: a GPU's (NCCL's own kernels and copy
            engines); on a CPU only where a core is free for gloo's threads (``local``: more cores
            than processes). Where not, every collective lengthens the step whole.
    """

    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    latency_s: float
    all_gather_factor: float = 1.0
    reduce_scatter_factor: float = 1.0
    overlaps: bool = True
    cores: int = 0
    source: str = field(default="", compare=False)  # where the figures come from (a file, a measurement)

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node


def presets() -> Dict[str, Path]:
    """The preset names (conf/cluster/NAME.yaml) and their files."""
    return {p.stem: p for p in sorted(CONF.glob("*.yaml"))}


def cluster(spec: Union[str, Mapping[str, Any], Cluster], *, devices: Optional[int] = None) -> Cluster:
    """The cluster ``spec`` names or describes.

    Args:
        spec: a preset's name (conf/cluster/NAME.yaml: ``h100_8``, ``h100_8x8``, ``a100_8x8``,
            ``h200_1``), ``"local"`` (this machine, calibrated once and cached), a mapping of
            :class:`Cluster`'s fields with ``device`` a mapping of :class:`Device`'s, or a cluster.
        devices: ``local``: the processes it runs (default 2); else the devices used of the cluster,
            on as few nodes as hold them (None: all).
    """
    if isinstance(spec, Cluster):
        return _used(spec, devices)
    if isinstance(spec, str):
        if spec == "local":
            return _local(devices)
        files = presets()
        if spec not in files:
            raise config_error(
                f"cluster={spec!r}",
                f"a cluster is a preset ({sorted(files)}), 'local', or a mapping of its fields",
                "pick a preset or describe the cluster (docs/LAYOUT.md, 'Describing a cluster')",
            )
        return _used(from_mapping(_read(files[spec]), source=str(files[spec])), devices)
    if not isinstance(spec, Mapping):
        raise config_error(f"cluster={spec!r}", "a name or a mapping", "see docs/LAYOUT.md")
    if spec.get("name") == "local" and set(spec) <= {"name", "devices"}:
        return _local(devices if devices is not None else spec.get("devices"))
    return _used(from_mapping(spec, source="given"), devices)


def _read(path: Path) -> Mapping[str, Any]:
    return dict(_parsed(path, path.stat().st_mtime_ns))


@functools.lru_cache(maxsize=64)
def _parsed(path: Path, mtime: int) -> Mapping[str, Any]:
    """A preset's mapping, parsed once per version of its file."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(data, dict), path
    return {str(k): v for k, v in data.items()}


def _local(devices: Optional[int]) -> Cluster:
    """This machine as ``devices`` processes (default 2) on one node, from its measurement
    (:func:`pipeckpt.layout.calibrate.measured`, cached). Each process runs at the one-thread matmul
    rate and AdamW's bandwidth while it has a core (the busy processes share the ``cores`` beyond),
    the machine's memory split evenly, and gloo's measured bandwidth, latency and collective factors
    between every pair.
    The measurement is the achieved rate, so the efficiency is 1."""
    from pipeckpt.layout.calibrate import measured

    n = 2 if devices is None else _count("devices", devices)
    m = measured()
    device = Device(
        name=f"{m['cpu']} ({m['cores']} cores), one torch thread per process",
        memory_bytes=int(m["memory_bytes"]) // n,
        peak_flops={"32-true": float(m["matmul_flops"])},
        memory_bytes_per_s=float(m["memory_bytes_per_s"]),
        efficiency=1.0,
    )
    link = float(m["gloo_bytes_per_s"])
    return Cluster(
        name="local",
        nodes=1,
        devices_per_node=n,
        device=device,
        intra_node_bytes_per_s=link,
        inter_node_bytes_per_s=link,
        latency_s=float(m["gloo_latency_s"]),
        all_gather_factor=float(m["gloo_all_gather_factor"]),
        reduce_scatter_factor=float(m["gloo_reduce_scatter_factor"]),
        overlaps=int(m["cores"]) > n,
        cores=int(m["cores"]),
        source=f"measured {m['when']} ({m['file']})",
    )


def _used(c: Cluster, devices: Optional[int]) -> Cluster:
    """``c`` cut to ``devices`` devices, on as few nodes as hold them."""
    if devices is None or devices == c.world:
        return c
    n = _count("devices", devices)
    if n > c.world:
        raise config_error(
            f"devices={n} on cluster {c.name!r}",
            f"the cluster has {c.world} devices ({c.nodes} x {c.devices_per_node})",
            "use fewer devices or a larger cluster",
        )
    if n <= c.devices_per_node:
        return replace(c, nodes=1, devices_per_node=n)
    if n % c.devices_per_node:
        raise config_error(
            f"devices={n} on cluster {c.name!r}",
            f"more than one node is used whole ({c.devices_per_node} devices each)",
            f"use a multiple of {c.devices_per_node} devices",
        )
    return replace(c, nodes=n // c.devices_per_node)


_CLUSTER_FIELDS = {
    "nodes": int,
    "devices_per_node": int,
    "intra_node_bytes_per_s": float,
    "inter_node_bytes_per_s": float,
    "latency_s": float,
}
_FACTORS = ("all_gather_factor", "reduce_scatter_factor")
_DEVICE_FIELDS = {"memory_bytes": int, "memory_bytes_per_s": float, "efficiency": float}


def from_mapping(spec: Mapping[str, Any], *, source: str = "given") -> Cluster:
    """A cluster from a mapping of its fields (a preset's YAML, a user's dict), every field
    checked: a wrong one is refused naming ``cluster.<field>``.

    Args:
        spec: :class:`Cluster`'s fields; ``device`` a mapping of :class:`Device`'s.
        source: where the mapping comes from, kept on the cluster.
    """
    known = {"name", "device", "source", "overlaps", "cores", *_CLUSTER_FIELDS, *_FACTORS}
    _no_unknown(spec, known, "cluster")
    values: Dict[str, Any] = {
        k: _number(f"cluster.{k}", spec.get(k), t, zero=k == "latency_s") for k, t in _CLUSTER_FIELDS.items()
    }
    for k in _FACTORS:  # optional: 1, the ring rule, unless given
        values[k] = _number(f"cluster.{k}", spec.get(k, 1.0), float)
    values["cores"] = _number("cluster.cores", spec.get("cores", 0), int, zero=True)
    values["overlaps"] = spec.get("overlaps", True)
    if not isinstance(values["overlaps"], bool):
        raise config_error(
            f"cluster.overlaps={values['overlaps']!r}",
            "true or false: whether communication runs beside compute",
            "set cluster.overlaps: false where collectives take the compute's own cores (CPUs)",
        )
    device = spec.get("device")
    if not isinstance(device, Mapping):
        raise config_error(
            f"cluster.device={device!r}",
            "the device is a mapping of name, memory_bytes, peak_flops, memory_bytes_per_s, efficiency",
            "describe the device under cluster.device (docs/LAYOUT.md)",
        )
    _no_unknown(device, {"name", "peak_flops", "host_bytes_per_s", *_DEVICE_FIELDS}, "cluster.device")
    dev: Dict[str, Any] = {
        k: _number(f"cluster.device.{k}", device.get(k), t) for k, t in _DEVICE_FIELDS.items()
    }
    if dev["efficiency"] > 1:
        raise config_error(
            f"cluster.device.efficiency={dev['efficiency']}",
            "achieved over peak is at most 1",
            "give the measured share of peak, e.g. 0.4",
        )
    host = device.get("host_bytes_per_s", 0.0)
    dev["host_bytes_per_s"] = _number("cluster.device.host_bytes_per_s", host or 0.0, float, zero=True)
    return Cluster(
        name=_name("cluster.name", spec.get("name")),
        device=Device(
            name=_name("cluster.device.name", device.get("name")),
            peak_flops=_peaks(device.get("peak_flops")),
            **dev,
        ),
        source=str(spec.get("source", source)),
        **values,
    )


def _no_unknown(spec: Mapping[str, Any], known: Set[str], where: str) -> None:
    unknown = sorted(str(k) for k in spec if k not in known)
    if unknown:
        raise config_error(
            f"{where}.{unknown[0]}",
            f"not a field of {where} (fields: {sorted(known)})",
            "check the spelling (docs/LAYOUT.md, 'Describing a cluster')",
        )


def _name(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise config_error(f"{where}={value!r}", "a name is a non-empty string", f"set {where}")
    return value


def _number(where: str, value: Any, kind: type, *, zero: bool = False) -> Any:
    """A positive number of ``kind`` (int: whole; ``zero``: 0 allowed), else the error naming ``where``."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > 0 or (zero and value == 0))
    )
    if ok and kind is int and float(value) != int(value):
        ok = False
    if not ok:
        what = (
            "a whole number of at least 1"
            if kind is int
            else "a positive number"
            if not zero
            else "0 or more"
        )
        raise config_error(f"{where}={value!r}", f"must be {what}", f"set {where} (docs/LAYOUT.md)")
    return kind(value)


def _count(where: str, value: Any) -> int:
    return int(_number(where, value, int))


def _peaks(value: Any) -> Dict[str, float]:
    if not isinstance(value, Mapping) or not value:
        raise config_error(
            f"cluster.device.peak_flops={value!r}",
            f"a mapping of precision name to dense FLOP/s ({list(PRECISION_NAMES)})",
            "e.g. peak_flops: {bf16-mixed: 989.4e12, 32-true: 66.9e12}",
        )
    out = {}
    for k, v in value.items():
        if k not in PRECISION_NAMES:
            raise config_error(
                f"cluster.device.peak_flops.{k}",
                f"not a precision name ({list(PRECISION_NAMES)})",
                "name the precision as Lightning does",
            )
        out[str(k)] = float(_number(f"cluster.device.peak_flops.{k}", v, float))
    return out
