"""Every setting of the ``pipe`` strategy, in one typed object.

:class:`PipeSettings` is the single source of a setting's name, type, default, meaning and
model-free check: ``PipelineStrategy(**settings)`` takes its keyword arguments from it, and the
app's Hydra schemas (:mod:`pipeckpt.app.config`) are generated from its fields. Checks run in
``__post_init__``, so a bad value fails with the same message from Python, a config or the
command line, before any work. Checks that need the model live in :mod:`pipeckpt.stages.partition`;
the engine-specific settings are each engine's own (:meth:`pipeckpt.engines.base.Engine.check_settings`).
"""

import difflib
import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from pipeckpt._errors import config_error
from pipeckpt.checkpointing.compiling import check_compile
from pipeckpt.checkpointing.layer_rng import LAYER_RNG, check_layer_rng
from pipeckpt.checkpointing.modes import CheckpointMode, parse_modes
from pipeckpt.settings_args import PipeSettingsArgs
from pipeckpt.settings_memory import MEMORY_SEARCH, check_memory_settings

__all__ = [
    "PipeSettings",
    "PipeSettingsArgs",
    "Modes",
    "BALANCE_BY",
    "LAYOUTS",
    "LAYER_RNG",
    "MEMORY_SEARCH",
    "check_balance_by",
    "check_layer_rng",
    "check_names",
]

BALANCE_BY = ("params", "time", "memory")
LAYOUTS = ("manual", "auto")

#: The checkpoint setting, parsed: ``"auto"`` or the modes as given (one for every stage, or one each).
Modes = Union[str, Tuple[CheckpointMode, ...]]


def _help(text: str) -> Dict[str, Any]:
    return {"help": text}


def _engine_help(text: str) -> Dict[str, Any]:
    """A setting only some engines run: unset (None) it takes the engine's default, and an engine
    that does not run it refuses it (:attr:`pipeckpt.engines.base.Engine.own_settings`)."""
    return {"help": text, "per_engine": True}


@dataclass(frozen=True)
class PipeSettings:
    """The settings of the ``pipe`` strategy. Each field's ``help`` says what it does.

    ``checkpoint`` keeps the spelling given (a mode's name, ``'auto'``, or a list of names; modes
    given as objects are kept by name); :attr:`modes` is the same parsed once.
    """

    stages: Optional[int] = field(
        default=None, metadata=_help("number of stages; default one per device (all on one device on CPU)")
    )
    balance: Optional[List[int]] = field(
        default=None, metadata=_help("layers per stage, e.g. [3, 3, 3, 3]; default automatic by balance_by")
    )
    balance_by: str = field(
        default="params",
        metadata=_help("automatic balance by 'params', or by profiled 'time' or 'memory' (CUDA)"),
    )
    chunks: int = field(default=1, metadata=_help("micro-batches per batch; one optimizer step per batch"))
    checkpoint: Any = field(
        default="except_last",
        metadata=_help(
            "one mode for all stages, or a list of one per stage: never, except_last, always, offload, "
            "selective; ':k' checkpoints every k layers apart, '+selective' keeps matmul outputs; "
            "or 'auto': chosen per stage under memory_budget"
        ),
    )
    memory_budget: Optional[Any] = field(
        default=None,
        metadata=_help(
            "checkpoint='auto': bytes per device the plan must fit, e.g. '20GiB', '512MiB' or a number"
        ),
    )
    memory_search: Optional[Any] = field(  # Any: a typed list field refuses the configs' interpolation
        default=None,
        metadata=_help("checkpoint='auto': what it chooses: a list of modes, chunks, balance"),
    )
    memory_optimizer: Optional[str] = field(
        default=None,
        metadata=_help(
            "checkpoint='auto': the optimizer whose state it counts (sgd, momentum, adam, adamw) "
            "instead of the one configure_optimizers returns"
        ),
    )
    placement: Optional[List[int]] = field(
        default=None,
        metadata=_engine_help("device index of each stage, to put several stages on one device (local)"),
    )
    deferred_batch_norm: bool = field(
        default=False,
        metadata=_help(
            "BatchNorm running statistics over the whole batch, committed once per batch; training "
            "still normalises each micro-batch by its own statistics (GPipe's rule), so a pipelined "
            "BatchNorm model trains differently from the unpipelined one"
        ),
    )
    layer_rng: str = field(
        default="auto",
        metadata=_help(
            "dropout masks independent of the layout: 'auto' (layers holding dropout draw from streams "
            "of their own), 'all' (every layer), or 'off' (the caller's generator)"
        ),
    )
    pin_memory: bool = field(default=True, metadata=_help("offload keeps stage inputs in pinned host memory"))
    compile: Any = field(
        default=False,
        metadata=_help(
            "torch.compile each layer's forward: False, True (inductor), an inductor mode "
            "('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs') "
            "or a compiler-free backend ('aot_eager', 'eager')"
        ),
    )
    strict: bool = field(
        default=True,
        metadata=_help(
            "a first training step that never calls the pipelined part is an error (False: a warning)"
        ),
    )
    engine: str = field(
        default="local", metadata=_help("'local' (one process) or 'distributed' (one process per stage)")
    )
    layout: str = field(
        default="manual",
        metadata=_help(
            "'manual' (the stages, degrees, schedule, chunks and modes as given) or 'auto': searched "
            "for the model on the cluster before the processes start, keeping those named (on the "
            "command line, or beside it in PipelineStrategy(layout='auto', cluster=...); docs/LAYOUT.md)"
        ),
    )
    schedule: Optional[str] = field(
        default=None,
        metadata=_engine_help("distributed: a schedule of torch.distributed.pipelining; default gpipe"),
    )
    dp: Optional[int] = field(
        default=None,
        metadata=_engine_help("distributed: replicas of the whole pipeline; default from the world size"),
    )
    virtual_stages: Optional[int] = field(
        default=None, metadata=_engine_help("distributed: stages per process (looped schedules); default 1")
    )
    timeout: Optional[float] = field(
        default=None, metadata=_engine_help("distributed: seconds a rank may wait for another; default 60")
    )
    start_timeout: Optional[float] = field(
        default=None,
        metadata=_engine_help("distributed: seconds every process may take to start; default 600"),
    )
    data_parallel: Optional[str] = field(
        default=None,
        metadata=_engine_help(
            "distributed: how the dp replicas of a stage keep its parameters, gradients and optimizer "
            "state: 'ddp' (whole copies; default) or 'fsdp' (FSDP2 shards over the replicas)"
        ),
    )
    reshard_after_forward: Optional[bool] = field(
        default=None,
        metadata=_engine_help(
            "distributed, data_parallel='fsdp': free gathered parameters after each micro-batch's "
            "forward (less memory, one more gather per backward); default False"
        ),
    )
    reduce_every_microbatch: Optional[bool] = field(
        default=None,
        metadata=_engine_help(
            "distributed, data_parallel='fsdp': reduce-scatter each micro-batch's gradients in its "
            "backward and keep only shards (less memory: no stage's whole gradients; one "
            "reduce-scatter per micro-batch); default False: once, after the last micro-batch"
        ),
    )
    dp_shard: Optional[int] = field(
        default=None,
        metadata=_engine_help(
            "distributed, data_parallel='fsdp': hybrid sharding (HSDP), each stage sharded over groups "
            "of dp_shard replicas and replicated across the dp / dp_shard groups; default dp (all)"
        ),
    )
    tensor_parallel: Optional[int] = field(
        default=None,
        metadata=_engine_help(
            "distributed: processes that split each pipeline rank's layers by tensor parallelism "
            "(pp x dp x tensor_parallel = the world size; needs data_parallel='fsdp'); default 1"
        ),
    )
    tensor_parallel_plan: Optional[Dict[str, str]] = field(
        default=None,
        metadata=_engine_help(
            "distributed, tensor_parallel > 1: how each pipelined layer is split, as {submodule path "
            "in the layer (fnmatch pattern): 'colwise' | 'rowwise'}, e.g. {'mlp.up': 'colwise', "
            "'mlp.down': 'rowwise'}; default for pipeline_of: the model's config.base_model_tp_plan"
        ),
    )
    sequence_parallel: Optional[bool] = field(
        default=None,
        metadata=_engine_help(
            "distributed, tensor_parallel > 1, pipeline_of: each layer's norms and residual stream, "
            "and what crosses a stage boundary, split along the sequence over the tensor-parallel "
            "ranks (Megatron-LM's sequence parallelism: 1/tp of those activations); default False "
            "(strategy.layout=auto on a described cluster: on wherever the model takes it)"
        ),
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _check_counts(self)
        check_balance_by(self.balance_by)
        check_layer_rng(self.layer_rng)
        object.__setattr__(self, "_modes", _parse_checkpoint(self))
        check_compile(self.compile, self.modes)
        search = check_memory_settings(
            self.checkpoint, self.memory_budget, self.memory_search, self.memory_optimizer
        )
        object.__setattr__(self, "memory_search", search)
        if self.balance is not None:
            object.__setattr__(self, "balance", [int(b) for b in self.balance])
        if self.placement is not None:
            object.__setattr__(self, "placement", [int(p) for p in self.placement])

    @property
    def modes(self) -> Modes:
        """``"auto"``, or the checkpoint modes: one for every stage, or one per stage."""
        modes: Modes = self.__dict__["_modes"]
        return modes

    def stage_modes(self, stages: int) -> Tuple[CheckpointMode, ...]:
        """One mode per stage of a pipeline of ``stages`` (a per-stage list must have as many)."""
        modes = self.modes
        assert not isinstance(modes, str), "checkpoint='auto' is chosen before the stages are planned"
        return parse_modes(modes[0] if _one_mode(self.checkpoint) else modes, stages)

    @property
    def stage_count(self) -> Optional[int]:
        """The stage count the settings fix, if any (by ``stages`` or by ``balance``)."""
        return len(self.balance) if self.balance is not None else self.stages

    @classmethod
    def per_engine(cls) -> List[str]:
        """The settings only some engines run (each engine lists its own, with their defaults)."""
        return [f.name for f in fields(cls) if f.metadata.get("per_engine")]

    @classmethod
    def signature(cls) -> inspect.Signature:
        """``(self, *, <every setting>=<its default>)``: a constructor's signature as tools read it."""
        return inspect.Signature(
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            + [
                inspect.Parameter(
                    f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
                )
                for f in fields(cls)
            ]
        )

    @classmethod
    def help(cls) -> List[Tuple[str, str, str]]:
        """``(name, default, meaning)`` of every setting, for docs and ``--help``."""
        return [(f.name, repr(f.default), f.metadata["help"]) for f in fields(cls)]


def check_names(given: Mapping[str, Any], what: str) -> None:
    """A name in ``given`` that is not a setting (a typo: ``chunk=4``) is refused, naming the closest."""
    names = [f.name for f in fields(PipeSettings)]
    unknown = sorted(set(given) - set(names))
    if not unknown:
        return
    close = [m for k in unknown for m in difflib.get_close_matches(k, names, n=1)]
    raise config_error(
        f"{what}({', '.join(f'{k}=...' for k in unknown)})",
        f"not a setting of the pipe strategy; the settings are {names}",
        (f"did you mean {', '.join(close)}? " if close else "") + "docs/SETTINGS.md lists every setting",
    )


def check_balance_by(balance_by: str) -> None:
    if balance_by not in BALANCE_BY:
        raise config_error(
            f"balance_by={balance_by!r}",
            f"must be one of {BALANCE_BY}",
            "choose params (default), time, or memory",
        )


def _one_mode(checkpoint: Any) -> bool:
    return isinstance(checkpoint, (str, CheckpointMode))


def _parse_checkpoint(s: PipeSettings) -> Modes:
    """The checkpoint setting parsed, once; modes given as objects are kept by name in ``checkpoint``."""
    names = [s.checkpoint] if _one_mode(s.checkpoint) else s.checkpoint
    if not isinstance(names, (list, tuple)):
        raise config_error(
            f"checkpoint={s.checkpoint!r}",
            "must be a mode name or a list of mode names, one per stage",
            "set checkpoint to a mode name (never, except_last, always, offload, selective, each "
            "optionally with :k or +selective) or a list such as ['always:1', 'never']",
        )
    if s.checkpoint == "auto":
        return "auto"
    modes = parse_modes(list(names), len(names))  # unknown names fail now; the length is checked per plan
    spelled = [m.name if isinstance(n, CheckpointMode) else n for n, m in zip(names, modes)]
    object.__setattr__(s, "checkpoint", spelled[0] if _one_mode(s.checkpoint) else spelled)
    return modes


def _check_types(s: PipeSettings) -> None:
    """Settings whose type no other check implies: switches and names."""
    for name in ("deferred_batch_norm", "pin_memory", "strict"):
        value = getattr(s, name)
        if not isinstance(value, bool):
            raise config_error(
                f"{name}={value!r}", "is a switch: True or False", f"set {name}=True or {name}=False"
            )
    for name in ("engine", "balance_by", "layer_rng"):
        value = getattr(s, name)
        if not isinstance(value, str):
            raise config_error(f"{name}={value!r}", "is a name (a string)", f"set {name} to one of its names")
    if s.layout not in LAYOUTS:
        raise config_error(
            f"layout={s.layout!r}",
            f"is one of {list(LAYOUTS)}",
            "set layout='auto' to search the layout, or leave it 'manual' (strategy.layout in the app)",
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_counts(s: PipeSettings) -> None:
    if not _is_count(s.chunks):
        raise config_error(
            f"chunks={s.chunks!r}",
            "the number of micro-batches must be an integer >= 1",
            "set chunks to 1 (no micro-batching) or more",
        )
    if s.stages is not None and not _is_count(s.stages):
        raise config_error(
            f"stages={s.stages!r}",
            "a pipeline needs an integer number of stages >= 1",
            "set stages >= 1, or leave it unset to use one stage per device",
        )
    _check_int_list("balance", s.balance, minimum=1, hint="give positive layer counts, one per stage")
    _check_int_list("placement", s.placement, minimum=0, hint="list a device index (0, 1, ...) per stage")
    if s.balance is not None and s.stages is not None and s.stages != len(s.balance):
        raise config_error(
            f"stages={s.stages} with balance {list(s.balance)}",
            "the balance lists one layer count per stage",
            "drop `stages` (the balance decides it) or make them agree",
        )


def _check_int_list(name: str, value: Optional[Sequence[Any]], *, minimum: int, hint: str) -> None:
    if value is None:
        return
    ok = isinstance(value, (list, tuple)) and len(value) > 0
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value)
    if not ok:
        raise config_error(f"{name}={value!r}", f"must be a non-empty list of integers >= {minimum}", hint)
