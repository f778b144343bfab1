"""Who runs what in the distributed engine, and the settings that cannot work.

The world is ``pp x dp x tp`` processes: ``dp`` replicas of one pipeline of ``pp``
ranks, each rank ``tp`` processes that split its layers' weights (tensor parallel)
and hold ``virtual_stages`` stages (stage ``j`` on pipeline rank ``j % pp``, torch's
interleaved layout). Global rank ``(replica * pp + pipeline rank) * tp + tp rank``:
the row-major order of the ``("dp", "pp", "tp")`` device mesh, tensor parallel
innermost as its collectives are the most frequent. Hybrid sharding (``dp_shard``)
views ``dp`` as ``(dp / dp_shard, dp_shard)``: each run of ``dp_shard`` consecutive
replicas shares one copy of the shards. All of it is arithmetic on settings, so a
bad combination fails when the Trainer is built, before any process starts.
"""

from dataclasses import dataclass, replace
from typing import List, Optional

from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.schedules import ScheduleKind, microbatch_rule

__all__: List[str] = []


@dataclass(frozen=True)
class Topology:
    pp: int
    dp: int
    virtual_stages: int
    kind: ScheduleKind
    tp: int = 1
    dp_shard: Optional[int] = None  # hybrid sharding: the replicas a stage is sharded over (< dp)

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def shard_degree(self) -> int:
        """The replicas that share one copy of a stage's shards: ``dp_shard``, else all of ``dp``."""
        return self.dp_shard or self.dp

    def shard_group(self, rank: int) -> List[int]:
        """The global ranks over which global ``rank``'s parameters are sharded (itself among them):
        the replicas of its replicate group at its pipeline and tensor-parallel position."""
        replica, k = self.replica_of(rank), self.shard_degree
        first = replica - replica % k
        return [self._at(first + i, rank) for i in range(k)]

    def replicate_group(self, rank: int) -> List[int]:
        """The global ranks that hold the same shards as global ``rank`` (itself among them)."""
        k = self.shard_degree
        return [self._at(self.replica_of(rank) % k + j * k, rank) for j in range(self.dp // k)]

    def _at(self, replica: int, rank: int) -> int:
        """The global rank of ``replica`` at global ``rank``'s pipeline and tensor-parallel position."""
        return self.global_rank(replica, self.pipeline_rank_of(rank), rank % self.tp)

    def pipeline_rank_of(self, rank: int) -> int:
        """The pipeline rank of global ``rank``."""
        return (rank // self.tp) % self.pp

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica of global ``rank``."""
        return rank // (self.pp * self.tp)

    def global_rank(self, replica: int, pipeline_rank: int, tp_rank: int = 0) -> int:
        """The global rank at (``replica``, ``pipeline_rank``, ``tp_rank``) of the mesh."""
        return (replica * self.pp + pipeline_rank) * self.tp + tp_rank

    def stages_of(self, rank: int) -> List[int]:
        """The stage indices global ``rank`` runs."""
        return self.kind.stages_of(self.pipeline_rank_of(rank), self.pp, self.stages)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank (not the global rank) that holds ``stage``."""
        return next(r for r in range(self.pp) if stage in self.kind.stages_of(r, self.pp, self.stages))

    def describe(self, rank: int) -> str:
        stages = ", ".join(map(str, self.stages_of(rank)))
        split = f", tensor-parallel rank {rank % self.tp}" if self.tp > 1 else ""
        if self.dp_shard is not None:
            split += f", sharded with ranks {self.shard_group(rank)}"
        return (
            f"rank {rank} (pipeline stage {stages} of data-parallel replica {self.replica_of(rank)}{split})"
        )


def check_kind(kind: ScheduleKind, virtual_stages: int) -> None:
    """Checks of the schedule against the stages per process, when the strategy is built."""
    if virtual_stages > 1 and not kind.looped:
        raise config_error(
            f"virtual_stages={virtual_stages} with schedule={kind.name!r}",
            "only a looped schedule runs several stages per process",
            "set schedule='interleaved_1f1b' (or another looped schedule), or virtual_stages=1",
        )
    if kind.traits.v_shape and virtual_stages != 2:
        raise config_error(
            f"virtual_stages={virtual_stages} with schedule={kind.name!r}",
            "a V-shaped schedule holds exactly two stages per process (stage j and 2 x pp - 1 - j)",
            "set virtual_stages=2",
        )


def resolve(
    *,
    world: int,
    stages: Optional[int],
    virtual_stages: int,
    dp: Optional[int],
    chunks: int,
    kind: ScheduleKind,
    tp: int = 1,
    dp_shard: Optional[int] = None,
) -> Topology:
    """``pp`` and ``dp`` for a world of ``world`` processes, ``tp`` of them to each pipeline rank
    of each replica: from ``dp`` if set, else from the stage count, else one pipeline over the
    whole world; ``dp_shard`` of the replicas share each copy of the shards."""
    v = virtual_stages
    if world % tp:
        raise config_error(
            f"tensor_parallel={tp} with a world of {world} processes",
            "pp x dp x tensor_parallel must equal the world size, so tensor_parallel must divide it",
            f"set tensor_parallel to a divisor of {world}, or run a multiple of {tp} processes "
            "(the trainer's devices x num_nodes)",
        )
    full, world = world, world // tp
    of_world = (
        f"a world of {full} processes" if tp == 1 else f"{world} = {full} processes / tensor_parallel={tp}"
    )
    product = "pp x dp" if tp == 1 else "pp x dp x tensor_parallel"
    if stages is not None and stages % v:
        raise config_error(
            f"{stages} stages with virtual_stages={v}",
            "every pipeline rank holds virtual_stages stages, so the stages must divide evenly "
            "into the processes of a pipeline",
            f"set stages to a multiple of {v} (for example {(stages // v + 1) * v})",
        )
    if dp is not None:
        if world % dp:
            raise config_error(
                f"dp={dp} with {of_world}",
                f"{product} must equal the world size, so dp must divide it",
                f"set dp to a divisor of {world}, or run a multiple of {dp * tp} processes "
                "(the trainer's devices x num_nodes)",
            )
        pp = world // dp
    elif stages is not None:
        pp = stages // v
        if world % pp:
            raise config_error(
                f"{stages} stages (pp={pp} with virtual_stages={v}) on {of_world}",
                f"{product} must equal the world size, so the pipeline ranks must divide it",
                f"run a multiple of {pp * tp} processes (the trainer's devices x num_nodes), or set "
                f"stages to {v} x a divisor of {world}",
            )
    else:
        pp = world
    topology = Topology(pp=pp, dp=world // pp, virtual_stages=v, kind=kind, tp=tp)
    if stages is not None and stages != topology.stages:
        raise config_error(
            f"{stages} stages on pp={pp} pipeline ranks ({of_world} = pp x dp={topology.dp}) "
            f"with virtual_stages={v}",
            "the stages must divide into the processes: stages = pp x virtual_stages",
            f"set stages={topology.stages}, or set dp so that pp = stages / virtual_stages = "
            f"{stages // v}, or change virtual_stages",
        )
    check_chunks(kind, chunks, pp=pp, stages=topology.stages)
    if dp_shard is not None:
        check_dp_shard(dp_shard, topology.dp, of_world)
        if dp_shard < topology.dp:  # dp_shard = dp is plain sharding over every replica
            topology = replace(topology, dp_shard=dp_shard)
    return topology


def check_dp_shard(dp_shard: int, dp: int, of_world: str) -> None:
    """A config error unless ``dp_shard`` divides the ``dp`` replicas into groups of equal size."""
    if dp % dp_shard:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        raise config_error(
            f"dp_shard={dp_shard} with dp={dp} ({of_world})",
            "hybrid sharding shards each stage over groups of dp_shard replicas and replicates it "
            "across dp / dp_shard such groups, so dp_shard must divide dp",
            f"set dp_shard to one of {divisors}, or set dp to a multiple of {dp_shard}",
        )


def check_chunks(kind: ScheduleKind, chunks: int, *, pp: int, stages: int) -> None:
    """A config error when ``kind`` cannot run ``chunks`` micro-batches on ``pp`` pipeline ranks."""
    problem = microbatch_rule(kind, chunks, pp, stages)
    if problem:
        raise config_error(
            f"chunks={chunks} with schedule={kind.name!r} on pp={pp}",
            problem,
            "raise chunks, or use schedule='gpipe'",
        )


def microbatches_for(size: int, *, chunks: int, topology: Topology, train: bool) -> int:
    """``chunks``, or the largest count below it that cuts a batch of ``size`` samples into
    equal micro-batches and fits the schedule (``torch.distributed.pipelining`` sends
    fixed-shape buffers, so micro-batches must be equal)."""
    kind, pp = topology.kind, topology.pp
    strict = train or kind.looped  # forward-only single-stage runs are GPipe

    def fits(m: int) -> bool:
        return size % m == 0 and not (strict and microbatch_rule(kind, m, pp, topology.stages))

    if fits(chunks):
        return chunks
    fewer = next((m for m in range(min(chunks, size), 0, -1) if fits(m)), None)
    if fewer is None:
        rule = microbatch_rule(kind, 1, pp, topology.stages) if strict else None
        raise config_error(
            f"a batch of {size} samples with chunks={chunks} and schedule={kind.name!r}",
            "the schedule needs equal micro-batches" + (f", and {rule}" if rule else ""),
            "use a batch size that is a multiple of chunks, or drop_last=True in the DataLoader",
        )
    return fewer
