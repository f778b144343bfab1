"""Every layout the distributed engine can run for a model on a world of processes.

Why arithmetic first: a layout that the engine would refuse, or whose degrees do not divide the
model, costs nothing to drop here, while every layout kept costs a memory prediction and a cost
estimate. The rules are the engine's own, read from where it keeps them: the schedules' traits and
micro-batch rules (:mod:`pipeckpt.engines.distributed.schedules`), ``pp x tp x dp = world`` with
``dp_shard`` dividing ``dp`` (:mod:`~pipeckpt.engines.distributed.topology`), a pipeline of at most one
stage per layer (:func:`pipeckpt.stages.partition.plan`), and equal micro-batches of the replica's
batch. Checkpoint modes are not enumerated: :mod:`pipeckpt.layout.fit` chooses them per layout with
:func:`pipeckpt.memory.auto.choose` under the device's memory.
"""

from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from pipeckpt._errors import config_error
from pipeckpt.engines.distributed.schedules import lookup, microbatch_rule
from pipeckpt.engines.distributed.tensor_parallel import under_fsdp

__all__ = ["SCHEDULES", "Candidate", "Model", "degrees", "virtual_stage_counts", "chunk_counts", "candidates"]

#: The schedules the distributed engine runs (its proven ones), by the name a setting takes.
SCHEDULES: Tuple[str, ...] = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dual_pipe_v",
)


@dataclass(frozen=True)
class Candidate:
    """One layout: degrees whose product is the world, a schedule with its stages per pipeline rank,
    micro-batches per step and a checkpoint mode per stage (empty until chosen)."""

    pp: int
    tp: int
    dp_replicate: int
    dp_shard: int
    schedule: str
    virtual_stages: int
    chunks: int
    modes: Tuple[str, ...] = ()
    reshard: bool = False  # FSDP2 frees the gathered parameters after each forward (dp_shard > 1)
    # FSDP2 reduce-scatters the gradients in every micro-batch's backward (dp_shard > 1, chunks > 1)
    reduce_every: bool = False
    # tp > 1 splits each layer's norms and residual stream along the sequence too (sequence parallelism)
    sequence: bool = False
    # layers per stage (empty: the engine's default cut, by parameters; else cut by time)
    balance: Tuple[int, ...] = ()
    # the balance is the user's own and not the cut by time (described so, not "by time")
    cut_by_hand: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        """``pp2 x tp2 (sp) x dp2 (fsdp 2)``: the degrees as a table's column reads them (``sp``:
        ``sequence_parallel``; ``reshard``: ``reshard_after_forward``; ``reduce every``:
        ``reduce_every_microbatch``)."""
        how = (", reshard" if self.reshard else "") + (", reduce every" if self.reduce_every else "")
        shard = f" (fsdp {self.dp_shard}{how})" if self.dp_shard > 1 else ""
        sp = " (sp)" if self.sequence else ""
        cut = (" by hand" if self.cut_by_hand else " by time") if self.balance else ""  # layout.balance
        return f"pp{self.pp}{cut} x tp{self.tp}{sp} x dp{self.dp}{shard}"

    def settings(self) -> Dict[str, Any]:
        """The ``pipe`` strategy's settings that run this layout under the distributed engine."""
        sharded = under_fsdp(self.dp_shard, self.tp)
        out: Dict[str, Any] = {
            "engine": "distributed",
            "stages": self.stages,
            "balance": list(self.balance) if self.balance else None,
            "dp": self.dp,
            "virtual_stages": self.virtual_stages,
            "schedule": self.schedule,
            "chunks": self.chunks,
            "data_parallel": "fsdp" if sharded else "ddp",
            "dp_shard": self.dp_shard if sharded and self.dp_shard < self.dp else None,
            "tensor_parallel": self.tp,
            # none without a split (the strategy refuses it there, whatever the user gave)
            "sequence_parallel": self.sequence if self.tp > 1 else None,
        }
        if self.dp_shard > 1:
            out["reshard_after_forward"] = self.reshard
            out["reduce_every_microbatch"] = self.reduce_every
        if self.modes:
            out["checkpoint"] = list(self.modes)
        return out


@dataclass(frozen=True)
class Model:
    """What the enumeration needs to know of a model.

    Args:
        layers: the pipelined Sequential's layers (a stage holds at least one).
        heads: attention heads a tensor-parallel degree must divide (and KV heads, where fewer).
        kv_heads: key-value heads (None: as many as ``heads``).
        tensor_parallel: whether the model can be split by tensor parallelism at all (built as one
            rank's share by a ``tensor_parallel`` argument, or a ``pipeline_of`` model with its own plan).
        sequence_parallel: whether its layouts with tp > 1 split the sequence too (one choice for
            them all: :func:`pipeckpt.plan_layout.sequence_choice` says why not both).
    """

    layers: int
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    tensor_parallel: bool = False
    sequence_parallel: bool = False


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degrees(
    world: int, model: Model, *, devices_per_node: Optional[int] = None
) -> Iterator[Tuple[int, int, int, int]]:
    """``(pp, tp, dp_replicate, dp_shard)`` with ``pp x tp x dp_replicate x dp_shard = world``: ``pp``
    at most the layers, ``tp`` dividing the heads and KV heads (1 where the model takes none) and,
    where ``devices_per_node`` is given, dividing it: the mesh puts tp innermost, so each tensor-
    parallel group then lies within one node. A group across nodes would run its collectives, several
    per layer on the critical path, over the network instead of the node's links (Megatron-LM SC'21,
    section 3.3: tensor parallelism within a node, pipelines across); left out, it halves a large
    world's enumeration (1,536 GPUs: 73,139 of 171,872 layouts had tp over 8 for a 96-head model)."""
    heads = [h for h in (model.heads, model.kv_heads) if h is not None]
    for tp in _divisors(world):
        if tp > 1 and (not model.tensor_parallel or not heads or any(h % tp for h in heads)):
            continue
        if devices_per_node is not None and devices_per_node % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > model.layers:
                continue
            dp = world // (tp * pp)
            for shard in _divisors(dp):
                yield pp, tp, dp // shard, shard


def virtual_stage_counts(schedule: str, pp: int, layers: int) -> List[int]:
    """Stages per pipeline rank ``schedule`` runs on ``pp`` ranks of a model of ``layers`` layers:
    1 for a single-stage schedule, exactly 2 for a V-shaped one, 2 to 4 for the other looped ones
    (each stage at least one layer); none on a single rank, where a schedule has nothing to loop."""
    kind = lookup(schedule)
    if not kind.looped:
        return [1]
    if pp == 1:
        return []
    counts = [2] if kind.traits.v_shape else [2, 3, 4]
    return [v for v in counts if pp * v <= layers]


def chunk_counts(
    schedule: str, *, pp: int, virtual_stages: int, replica_batch: int, most: Optional[int] = None
) -> List[int]:
    """Micro-batch counts for ``schedule``: divisors of the replica's batch (equal micro-batches),
    at most ``most``, that the schedule runs on its stages (:func:`microbatch_rule`)."""
    kind = lookup(schedule)
    stages = pp * virtual_stages
    return [
        c
        for c in _divisors(replica_batch)
        if (most is None or c <= most) and microbatch_rule(kind, c, pp, stages) is None
    ]


def candidates(
    world: int,
    model: Model,
    *,
    global_batch: int,
    schedules: Sequence[str] = SCHEDULES,
    most_chunks: Optional[int] = None,
    devices_per_node: Optional[int] = None,
) -> List[Candidate]:
    """Every layout of ``world`` processes the engine runs for ``model`` with ``global_batch``
    samples a step: degrees, schedule, stages per rank and chunks (modes left to choose). A
    single-rank pipeline is listed under gpipe only (every schedule runs one stage alike), and a
    data-parallel degree must divide the global batch (each replica takes an equal share). A layout
    that shards with FSDP is listed twice: parameters kept gathered through the step (the engine's
    default) and freed after each forward (``reshard_after_forward``: less memory, gathered again);
    with more than one micro-batch and a whole backward each, twice again: gradients reduced once a
    step (whole until then) and in every micro-batch's backward (``reduce_every_microbatch``:
    shards only, a reduce-scatter per micro-batch). ``devices_per_node``: tensor parallelism within a
    node only (:func:`degrees`). Every layout with tp > 1 runs sequence parallelism where
    ``model.sequence_parallel`` says so, none otherwise."""
    if world < 1 or global_batch < 1:
        raise config_error(
            f"a world of {world} processes with a global batch of {global_batch}",
            "a layout search needs at least one process and one sample a step",
            "set trainer.devices and data.batch_size to 1 or more",
        )
    for name in schedules:
        lookup(name)  # an unknown or unproven schedule is refused by name
    out = []
    for pp, tp, replicate, shard in degrees(world, model, devices_per_node=devices_per_node):
        dp = replicate * shard
        if global_batch % dp:
            continue
        for schedule in schedules if pp > 1 else ("gpipe",):
            for v in virtual_stage_counts(schedule, pp, model.layers):
                for chunks in chunk_counts(
                    schedule, pp=pp, virtual_stages=v, replica_batch=global_batch // dp, most=most_chunks
                ):
                    each = shard > 1 and chunks > 1 and not lookup(schedule).traits.split_backward
                    for reshard in (False, True) if shard > 1 else (False,):
                        for reduce in (False, True) if each else (False,):
                            c = Candidate(pp, tp, replicate, shard, schedule, v, chunks, reshard=reshard)
                            out.append(
                                replace(c, reduce_every=reduce, sequence=model.sequence_parallel and tp > 1)
                            )
    return out
