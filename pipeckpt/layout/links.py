"""Which link each message of a layout crosses, and what a collective over it costs.

Why from the engine's mesh: whether a tensor-parallel group, a shard group or two neighbouring
stages sit in one node decides NVLink or the network, a factor of ten. The ranks are the
distributed engine's (pipeckpt/engines/distributed/topology.py): global rank
``(replica * pp + pipeline rank) * tp + tp rank``, tensor parallel innermost, then the pipeline,
then the replicas, and replica ``g * dp_shard`` to ``(g + 1) * dp_shard - 1`` one shard group; nodes
hold consecutive ranks. Collectives are costed as rings (the alpha-beta model, Thakur et al. 2005,
as NCCL's ring runs them): an all-reduce over ``n`` ranks moves ``2 (n - 1) / n`` of the buffer
through each rank's link, an all-gather or reduce-scatter ``(n - 1) / n``, each after a latency.
"""

import functools
from typing import Iterable

from pipeckpt.layout.cluster import Cluster

__all__ = ["Mesh", "all_reduce_s", "gather_s", "send_s"]


class Mesh:
    """The engine's rank arithmetic for one layout on one cluster."""

    def __init__(self, cluster: Cluster, *, pp: int, tp: int, dp_replicate: int, dp_shard: int) -> None:
        self.cluster, self.pp, self.tp = cluster, pp, tp
        self.replicate, self.shard = dp_replicate, dp_shard
        self.dp = dp_replicate * dp_shard

    def rank(self, replica: int, prank: int, t: int = 0) -> int:
        return (replica * self.pp + prank) * self.tp + t

    def _bandwidth(self, key: str) -> float:
        return _bandwidth(self.cluster, self.pp, self.tp, self.replicate, self.shard, key)

    @property
    def tp_bytes_per_s(self) -> float:
        return self._bandwidth("tp")

    @property
    def shard_bytes_per_s(self) -> float:
        return self._bandwidth("shard")

    @property
    def replicate_bytes_per_s(self) -> float:
        return self._bandwidth("replicate")

    @property
    def dp_bytes_per_s(self) -> float:
        return self._bandwidth("dp")

    def boundary_bytes_per_s(self, prank: int, next_prank: int) -> float:
        """The slowest link, over the replicas, between pipeline ranks ``prank`` and ``next_prank``."""
        return _boundary(self.cluster, self.pp, self.tp, self.dp, prank, next_prank)


def _node_link(cluster: Cluster, ranks: Iterable[int]) -> float:
    nodes = {r // cluster.devices_per_node for r in ranks}
    return cluster.intra_node_bytes_per_s if len(nodes) <= 1 else cluster.inter_node_bytes_per_s


@functools.lru_cache(maxsize=4096)
def _bandwidth(cluster: Cluster, pp: int, tp: int, replicate: int, shard: int, key: str) -> float:
    """The slowest of every instance of a group kind: a ring runs at its slowest link."""
    mesh = Mesh(cluster, pp=pp, tp=tp, dp_replicate=replicate, dp_shard=shard)
    dp = replicate * shard
    worst = float("inf")
    for replica in range(dp):
        for prank in range(pp):
            if key == "tp":
                ranks = [mesh.rank(replica, prank, t) for t in range(tp)]
            elif key == "shard":
                first = replica - replica % shard
                ranks = [mesh.rank(first + i, prank) for i in range(shard)]
            elif key == "replicate":
                ranks = [mesh.rank(replica % shard + g * shard, prank) for g in range(replicate)]
            else:
                ranks = [mesh.rank(x, prank) for x in range(dp)]
            worst = min(worst, _node_link(cluster, ranks))
    return worst


@functools.lru_cache(maxsize=4096)
def _boundary(cluster: Cluster, pp: int, tp: int, dp: int, prank: int, nxt: int) -> float:
    worst = float("inf")
    for replica in range(dp):
        a, b = (replica * pp + prank) * tp, (replica * pp + nxt) * tp
        worst = min(worst, _node_link(cluster, (a, b)))
    return worst


def all_reduce_s(nbytes: float, n: int, bytes_per_s: float, latency_s: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks: ``latency + 2 (n - 1) / n x bytes / bw``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return latency_s + 2 * (n - 1) / n * nbytes / bytes_per_s


def gather_s(nbytes: float, n: int, bytes_per_s: float, latency_s: float) -> float:
    """A ring all-gather (or reduce-scatter) whose whole result is ``nbytes``:
    ``latency + (n - 1) / n x bytes / bw``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return latency_s + (n - 1) / n * nbytes / bytes_per_s


def send_s(nbytes: float, bytes_per_s: float, latency_s: float) -> float:
    """One point-to-point message."""
    return latency_s + nbytes / bytes_per_s if nbytes > 0 else 0.0
