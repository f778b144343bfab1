"""Processes and mesh of the distributed engine: who runs which stage, and the groups they talk in.

The world is ``pp x dp x tp`` processes on one ``DeviceMesh`` ``("dp", "pp", "tp")`` (``("dp",
"pp")`` without tensor parallelism, ``("pp",)`` without data or tensor parallelism, where the
pipeline is the whole world; :mod:`~pipeckpt.engines.distributed.topology`). This module resolves the
topology as soon as the Trainer knows the world size (so bad combinations fail
before any process starts), picks the launcher, opens the process groups, and
starts the liveness beat that names a lost rank.
"""

import os
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeckpt._compat import (
    default_process_group_backend,
    default_store,
    init_dist_connection,
)
from pipeckpt._errors import config_error
from pipeckpt.engines.base import World
from pipeckpt.engines.distributed.auto_plan import check_auto
from pipeckpt.engines.distributed.children import ScriptLauncher
from pipeckpt.engines.distributed.kept_groups import kept
from pipeckpt.engines.distributed.liveness import Liveness
from pipeckpt.engines.distributed.schedules import ScheduleKind, lookup
from pipeckpt.engines.distributed.sharding import check_data_parallel, check_reduce_every
from pipeckpt.engines.distributed.startup import rendezvous
from pipeckpt.engines.distributed.tensor_parallel import check_tensor_parallel
from pipeckpt.engines.distributed.topology import Topology, check_kind, resolve
from pipeckpt.settings import PipeSettings

__all__: List[str] = []

#: The settings only this engine runs, with the value each takes when left unset.
SETTINGS: Dict[str, Any] = {
    "schedule": "gpipe",
    "dp": None,
    "virtual_stages": 1,
    "timeout": 60.0,
    "start_timeout": 600.0,
    "data_parallel": "ddp",
    "reshard_after_forward": False,
    "reduce_every_microbatch": False,
    "dp_shard": None,
    "tensor_parallel": 1,
    "tensor_parallel_plan": None,
    "sequence_parallel": False,
}


def check_process_settings(s: PipeSettings) -> None:
    """This engine's settings (resolved), before any process: counts and a time limit, a schedule
    that exists, fits ``virtual_stages`` and runs the modes (``checkpoint='auto'``: can plan)."""
    if s.dp is not None and not _is_count(s.dp):
        raise config_error(
            f"dp={s.dp!r}", "the data-parallel size is an integer >= 1", "set dp >= 1, or leave it unset"
        )
    if s.virtual_stages is not None and not _is_count(s.virtual_stages):
        raise config_error(
            f"virtual_stages={s.virtual_stages!r}",
            "a pipeline rank holds an integer number >= 1 of stages",
            "set virtual_stages >= 1",
        )
    limits = {
        "timeout": (s.timeout, "a collective", 60),
        "start_timeout": (s.start_timeout, "the start-up", 600),
    }
    for name, (limit, what, example) in limits.items():
        if limit is not None:
            check_time_limit(name, limit, what, example)
    check_data_parallel(s)
    check_tensor_parallel(s)
    assert s.schedule is not None and s.virtual_stages is not None
    kind = lookup(s.schedule)
    check_kind(kind, s.virtual_stages)
    check_reduce_every(s, kind.traits.split_backward)
    check_auto(s)  # checkpoint='auto': gpipe or 1f1b, the stage count fixed


def check_time_limit(name: str, limit: Any, what: str, example: float) -> float:
    """``limit``, a setting's seconds, if positive and finite; else the error naming ``name``."""
    if (
        not isinstance(limit, (int, float))
        or isinstance(limit, bool)
        or not 0 < limit <= timedelta.max.total_seconds()
    ):
        raise config_error(
            f"{name}={limit:g}" if isinstance(limit, (int, float)) else f"{name}={limit!r}",
            f"{what} needs a positive, finite time limit",
            f"set {name} in seconds, e.g. {example:g}",
        )
    return float(limit)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class ProcessGroups:
    """The world, its topology, the ``pp``/``dp`` process groups of this process and the mesh."""

    def __init__(self, settings: PipeSettings, kind: ScheduleKind) -> None:
        self.settings = settings
        self.kind = kind
        self.world = World(num_nodes=1, num_processes=1)
        self.topology: Optional[Topology] = None
        self.pp_group: Optional[dist.ProcessGroup] = None
        self.dp_group: Optional[dist.ProcessGroup] = None
        # ("dp", "pp"[, "tp"]), or ("pp",) for a pipeline alone; on this process's device type
        self.mesh: Optional[DeviceMesh] = None
        self.liveness: Optional[Liveness] = None

    def configure(self, world: World) -> Topology:
        s = self.settings
        assert s.virtual_stages is not None
        self.world = world
        self.topology = resolve(
            world=world.size,
            virtual_stages=s.virtual_stages,
            stages=s.stage_count,
            dp=s.dp,
            chunks=s.chunks,
            kind=self.kind,
            tp=s.tensor_parallel or 1,
            dp_shard=s.dp_shard,
        )
        return self.topology

    @property
    def rank(self) -> int:
        return self.world.global_rank

    @property
    def pipeline_rank(self) -> int:
        assert self.topology is not None
        return self.topology.pipeline_rank_of(self.rank)

    @property
    def replica(self) -> int:
        assert self.topology is not None
        return self.topology.replica_of(self.rank)

    def launcher(self, environment: ClusterEnvironment) -> Any:
        _check_slurm_tasks(environment, devices=self.world.num_processes, num_nodes=self.world.num_nodes)
        return ScriptLauncher(environment, self.world.num_processes, self.world.num_nodes)

    def connect(self, environment: ClusterEnvironment, device: torch.device) -> None:
        assert self.topology is not None and self.settings.timeout is not None
        options: Dict[str, Any] = {"timeout": timedelta(seconds=self.settings.timeout)}
        if not dist.is_initialized():  # the step timeout for collectives, start_timeout to start
            assert self.settings.start_timeout is not None
            options["store"] = rendezvous(
                environment,
                rank=self.rank,
                world_size=self.world.size,
                window_s=float(self.settings.start_timeout),
                describe=self.topology.describe,
            )
        if device.type != "cpu":
            options["device_id"] = device
        init_dist_connection(environment, default_process_group_backend(device), **options)
        t = self.topology
        shape: Tuple[int, ...]
        names: Tuple[str, ...]
        if t.dp == 1 and t.tp == 1 and self.settings.data_parallel != "fsdp":
            # The pipeline is the whole world and nothing else needs a dimension: a mesh of
            # ``pp`` alone, whose group is the default one. A ``dp`` dimension of one process
            # would open a process group on every process that nothing uses (on gloo three threads,
            # one waking every 10 ms; benchmarks/RESULTS.md, host cost, 2026-11-27).
            shape, names = (t.pp,), ("pp",)
        elif t.tp > 1:
            shape, names = (t.dp, t.pp, t.tp), ("dp", "pp", "tp")
        else:
            shape, names = (t.dp, t.pp), ("dp", "pp")
        # made once per process and default group, for every fit (kept_groups: why)
        mesh = kept(
            ("mesh", device.type, shape, names),
            lambda: init_device_mesh(device.type, shape, mesh_dim_names=names),
        )
        if names == ("pp",):
            self.pp_group, self.dp_group = mesh.get_group(), None
        else:
            self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        self.mesh = mesh
        self.liveness = Liveness(default_store(), rank=self.rank, world_size=self.world.size)
        self.liveness.start()

    @property
    def connected(self) -> bool:
        return self.pp_group is not None and dist.is_initialized()

    def from_last_stage(self, payload: Any) -> Any:
        """``payload`` of the pipeline's last rank, on every rank of the pipeline."""
        assert self.topology is not None
        if self.topology.pp == 1 or self.pp_group is None:
            return payload
        box = [payload]
        src = dist.get_global_rank(self.pp_group, self.topology.rank_of(self.topology.stages - 1))
        dist.broadcast_object_list(box, src=src, group=self.pp_group)
        return box[0]

    def gathered_on_zero(self, piece: Any) -> Optional[List[Any]]:
        """Every rank's ``piece`` on global rank 0 (a collective), else None."""
        pieces = [None] * self.world.size if self.rank == 0 else None
        dist.gather_object(piece, pieces, dst=0)
        return pieces

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
            self.liveness = None


def _check_slurm_tasks(environment: Any, *, devices: int, num_nodes: int) -> None:
    if not isinstance(environment, SLURMEnvironment):
        return
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    count = per_node.split("(")[0]  # "2(x3)": 2 tasks on each of 3 nodes
    if count.isdigit() and int(count) != devices:
        raise config_error(
            f"devices={devices} with SLURM --ntasks-per-node={per_node}",
            "the distributed engine runs one process per device, and SLURM starts "
            "--ntasks-per-node of them on each node, so the two must agree",
            f"set the trainer's devices={count} (pp x dp = {int(count) * num_nodes} processes "
            f"on {num_nodes} node(s)), or change --ntasks-per-node",
        )
