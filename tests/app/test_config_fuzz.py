"""Config fuzzing: random strategy settings and Hydra overrides (issue 11, item 6).

Hand-written cases cover the mistakes someone thought of; these tests draw settings
at random, valid and invalid values of every field, wrong types, unknown keys and
local/distributed combinations, and check that each one either fails with one clean
:class:`~pipeckpt.PipeckptConfigError` (or Hydra's own error, for a type its schema
owns) before any training step, or works: a small valid one trains one step of the
toy module under the local engine; a distributed one builds its Trainer (no process
is launched here).

Which outcome each example must have is decided by :func:`settings_problems`,
:func:`world_problems` and :func:`model_problems`, a reference model of the rules
written from their documentation (``PipeSettings``' help, the
README, torch's schedule docs), not from the checks' code. When the code and the
model disagree, Hypothesis shrinks the example to a minimal one.

Bugs found this way are kept below as minimal ``xfail(strict=True)`` examples; the
fuzzers skip their inputs (:data:`AWAITING_FIX`) until the fix lands: then flip the
xfail and drop the entry.

Hypothesis runs derandomized (a fixed seed, no example database), so CI sees the
same examples every run; ``max_examples`` keeps the file under a minute on 2 cores.
"""

import math
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from support.toy import ToyModule, fit, params

import train
from pipeckpt import PipeckptConfigError, PipeckptWarning, PipelineStrategy
from pipeckpt.app.config import register

CONF = Path(__file__).resolve().parents[2] / "conf"
BATCH = 16  # toy_loader's batch size


def fuzz(examples: int) -> Callable[[Any], Any]:
    """Reproducible in CI: a fixed seed, no database, no time limit per example."""
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# -- the rules, as documented ----------------------------------------------------------

FIELDS = (
    "stages",
    "balance",
    "balance_by",
    "chunks",
    "checkpoint",
    "placement",
    "deferred_batch_norm",
    "pin_memory",
    "compile",
    "engine",
    "schedule",
    "dp",
    "virtual_stages",
    "timeout",
)
MODES = ("never", "except_last", "always", "offload")
BALANCE_BY = ("params", "time", "memory")
DISTRIBUTED_ONLY = ("schedule", "dp", "virtual_stages", "timeout")
COMPILE_NAMES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # inductor modes
COMPILE_NAMES += ("aot_eager", "eager")  # backends that need no compiler


@dataclass(frozen=True)
class Schedule:
    """What torch's docs say of a schedule, as far as the settings care."""

    looped: bool = False  # several stages per process (virtual_stages > 1 allowed)
    v_shape: bool = False  # exactly two stages per process
    microbatches_at_least_stages: bool = False  # 1F1B: >= pp; DualPipeV: >= its stages
    rounds_of_pp: bool = False  # the micro-batches run in equal rounds of about pp


# Keyed by torch's class name without "Schedule", lower case; users may add underscores.
SCHEDULES: Dict[str, Schedule] = {
    "gpipe": Schedule(),
    "1f1b": Schedule(microbatches_at_least_stages=True),
    "interleaved1f1b": Schedule(looped=True, rounds_of_pp=True),
    "loopedbfs": Schedule(looped=True, rounds_of_pp=True),
    "interleavedzerobubble": Schedule(looped=True, rounds_of_pp=True),
    "zbvzerobubble": Schedule(looped=True, v_shape=True),
    "dualpipev": Schedule(looped=True, v_shape=True, microbatches_at_least_stages=True),
}


@dataclass(frozen=True)
class Problem:
    """One broken rule: the setting the message must name, and when it must be caught."""

    field: str
    when: str  # "settings": PipelineStrategy(...); "world": Trainer(...); "model": fit's set-up


def _count(v: Any, minimum: int = 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _counts(v: Any, minimum: int) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(_count(x, minimum) for x in v)


def _mode_names(v: Any) -> Optional[List[str]]:
    """The modes a ``checkpoint`` value names, or None if it is not a mode name or a list of them."""
    names = [v] if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) else None
    if names is None or not all(isinstance(n, str) and n in MODES for n in names):
        return None
    return names


def _schedule(v: Any) -> Optional[Schedule]:
    if v is None:
        return SCHEDULES["gpipe"]
    return SCHEDULES.get(v.replace("_", "").lower()) if isinstance(v, str) else None


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def settings_problems(kw: Dict[str, Any]) -> List[Problem]:
    """Rules that need neither model nor world: PipelineStrategy(...) itself refuses these."""
    out = [Problem(k, "settings") for k in kw if k not in FIELDS]
    s = {"balance_by": "params", "chunks": 1, "checkpoint": "except_last", "engine": "local"}
    s.update({k: None for k in ("stages", "balance", "placement", *DISTRIBUTED_ONLY)})
    s.update({"deferred_batch_norm": False, "pin_memory": True, "compile": False})
    s.update({k: v for k, v in kw.items() if k in FIELDS})
    bad = {
        "chunks": not _count(s["chunks"]),
        "stages": s["stages"] is not None and not _count(s["stages"]),
        "balance": s["balance"] is not None and not _counts(s["balance"], 1),
        "placement": s["placement"] is not None and not _counts(s["placement"], 0),
        "balance_by": not (isinstance(s["balance_by"], str) and s["balance_by"] in BALANCE_BY),
        "checkpoint": _mode_names(s["checkpoint"]) is None,
        "deferred_batch_norm": not isinstance(s["deferred_batch_norm"], bool),
        "pin_memory": not isinstance(s["pin_memory"], bool),
        "compile": not (isinstance(s["compile"], bool) or s["compile"] in COMPILE_NAMES),
        "engine": not (isinstance(s["engine"], str) and s["engine"] in ("local", "distributed")),
    }
    if not bad["stages"] and not bad["balance"] and None not in (s["stages"], s["balance"]):
        bad["stages"] = s["stages"] != len(s["balance"])
    if s["engine"] == "local":
        bad.update({k: s[k] is not None for k in DISTRIBUTED_ONLY})
    if s["engine"] == "distributed":
        bad["placement"] = s["placement"] is not None
        bad["dp"] = s["dp"] is not None and not _count(s["dp"])
        bad["virtual_stages"] = s["virtual_stages"] is not None and not _count(s["virtual_stages"])
        t = s["timeout"]
        # A timeout is a time limit a collective can be given: positive, finite, within a timedelta.
        bad["timeout"] = t is not None and not (
            _real(t) and 0 < t <= timedelta.max.total_seconds()  # False for nan
        )
        kind = _schedule(s["schedule"])
        bad["schedule"] = kind is None
        v = s["virtual_stages"] if s["virtual_stages"] is not None else 1
        if kind is not None and not bad["virtual_stages"]:
            if (v > 1 and not kind.looped) or (kind.v_shape and v != 2):
                out.append(Problem("virtual_stages", "settings"))
    return out + [Problem(k, "settings") for k, b in bad.items() if b]


def world_problems(kw: Dict[str, Any], world: int) -> List[Problem]:
    """The distributed engine's topology (pp x dp processes) against the Trainer's world."""
    kind = _schedule(kw.get("schedule"))
    assert kind is not None
    v, dp, chunks = kw.get("virtual_stages") or 1, kw.get("dp"), kw.get("chunks", 1)
    stages = len(kw["balance"]) if kw.get("balance") is not None else kw.get("stages")
    if stages is not None and stages % v:
        return [Problem("stages", "world")]
    if dp is not None:
        if world % dp:
            return [Problem("dp", "world")]
        pp = world // dp
    elif stages is not None:
        pp = stages // v
        if world % pp:
            return [Problem("stages", "world")]
    else:
        pp = world
    if stages is not None and stages != pp * v:
        return [Problem("stages", "world")]
    if kind.microbatches_at_least_stages and chunks < (pp * v if kind.looped else pp):
        return [Problem("chunks", "world")]
    if kind.rounds_of_pp and chunks % max(1, chunks // pp):
        return [Problem("chunks", "world")]
    modes = kw.get("checkpoint")
    if isinstance(modes, (list, tuple)) and len(modes) != pp * v:
        return [Problem("checkpoint", "world")]  # one mode per stage, checked before any rank starts
    return []


def local_stage_count(kw: Dict[str, Any], *, layers: int, devices: int) -> int:
    if kw.get("balance") is not None:
        return len(kw["balance"])
    return kw.get("stages") or max(1, min(devices, layers))


def model_problems(kw: Dict[str, Any], *, layers: int, devices: int) -> List[Problem]:
    """The local engine's plan against the module's Sequential of ``layers`` layers."""
    out = []
    stages = local_stage_count(kw, layers=layers, devices=devices)
    balance, placement = kw.get("balance"), kw.get("placement")
    if balance is not None and sum(balance) != layers:
        out.append(Problem("balance", "model"))
    if stages > layers:
        out.append(Problem("stages", "model"))
    modes = _mode_names(kw.get("checkpoint", "except_last"))
    if modes is not None and not isinstance(kw.get("checkpoint", ""), str) and len(modes) != stages:
        out.append(Problem("checkpoint", "model"))
    if placement is not None and (len(placement) != stages or max(placement) >= devices):
        out.append(Problem("placement", "model"))
    if balance is None and kw.get("balance_by", "params") != "params":  # profiling needs an example input
        out.append(Problem("balance_by", "model"))
    return out


def assert_names_one_of(error: BaseException, problems: Sequence[Problem]) -> None:
    """The uniform message (``<value>: <rule>. HINT: <fix>``) names one of the broken settings."""
    message = str(error)
    assert isinstance(error, PipeckptConfigError), repr(error)
    assert ": " in message.split(". HINT: ")[0] and message.count("HINT: ") == 1, message
    assert any(p.field in message for p in problems), (message, problems)


# -- known bugs: minimal examples, and the inputs the fuzzers skip until they are fixed ------------

AWAITING_FIX: Dict[str, Callable[[Dict[str, Any]], bool]] = {}


def awaiting_fix(kw: Dict[str, Any]) -> bool:
    return any(hit(kw) for hit in AWAITING_FIX.values())


def test_an_unhashable_engine_is_a_config_error():
    with pytest.raises(PipeckptConfigError, match=r"engine=\['local'\]"):
        PipelineStrategy(engine=["local"])


@pytest.mark.parametrize("name", ["deferred_batch_norm", "pin_memory"])
def test_a_non_bool_switch_is_a_config_error(name):
    with pytest.raises(PipeckptConfigError, match=f"{name}='no'"):
        PipelineStrategy(**{name: "no"})


@pytest.mark.parametrize("timeout", [math.inf, 1e300])
def test_an_infinite_timeout_is_a_config_error(timeout):
    with pytest.raises(OverflowError):  # what the engine's process group set-up would do with it
        timedelta(seconds=timeout)
    with pytest.raises(PipeckptConfigError, match="timeout="):
        PipelineStrategy(engine="distributed", timeout=timeout)


def test_chunks_beyond_int64_fail_cleanly_or_train():
    # Any integer chunks >= 1 is documented valid: a batch too small makes fewer micro-batches (a warning).
    module = CountingToy(depth=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", PipeckptWarning)
        trainer = fit(module, PipelineStrategy(chunks=2**63), steps=1)
    assert (trainer.global_step, module.steps) == (1, 1)
    assert any("fewer micro-batches" in str(w.message) for w in seen)


# -- 1a. Python settings, local engine: fail cleanly before a step, or train one step -------------


class CountingToy(ToyModule):
    """The toy module, counting the training steps that ran."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return super().training_step(batch, batch_idx)


def _one_in(n: int, *rare: str) -> st.SearchStrategy:
    """Each of ``rare`` one time in ``n``, else "keep" (which is also what examples shrink to)."""
    return st.sampled_from(["keep"] * (n - len(rare)) + list(rare))


_MODE = st.sampled_from(MODES)
_MODE_LIST = st.lists(_MODE, min_size=1, max_size=4)
_BAD_MODES = ["sometimes", "ALWAYS", None, 3, {"always": 1}, {"always"}, ["always", "sometimes"], [["never"]]]
_BAD_LOCAL: Dict[str, Sequence[Any]] = {
    "stages": [0, -1, True, 2.0, "2"],
    "balance": [[], [0, 2], [2.0, 1], [True, 2], "3,3", 3],
    "balance_by": ["luck", "PARAMS", None, 1, ["params"]],
    "chunks": [0, -1, True, 2.0, "4", None, 2**63],
    "checkpoint": _BAD_MODES,
    "placement": [[], [-1], [0.0], [True], "0"],
    "deferred_batch_norm": ["no", 1, None],
    "pin_memory": ["no", 0, None],
    "compile": ["yes", 1, None, "inductor", "max_autotune", ["eager"]],
    "engine": ["remote", "Local", None, 5, ["local"]],
}


def _split(layers: int, stages: int) -> st.SearchStrategy:
    """A balance of ``stages`` stages that sums to ``layers``: cut points between layers."""
    cuts = st.lists(st.integers(1, layers - 1), unique=True, min_size=stages - 1, max_size=stages - 1)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *sorted(c)], [*sorted(c), layers])])


def _other_local(stages: int, devices: int, layers: int) -> Dict[str, st.SearchStrategy]:
    """Well-typed values that may not fit the model: a count one off, an index one past the devices."""
    near = st.integers(max(1, stages - 1), stages + 1)
    index = st.integers(0, devices)
    past = st.integers(0, stages - 1).map(lambda i: [0] * i + [devices] + [0] * (stages - 1 - i))
    return {
        "stages": st.integers(layers + 1, 8),
        "balance": st.one_of(
            _split(layers + 1, stages),  # one layer too many
            st.lists(st.integers(0, 3), min_size=1, max_size=4),  # 0: a stage without layers
        ),
        "balance_by": st.sampled_from(["time", "memory"]),  # profiling needs an example input
        "chunks": st.integers(1, BATCH + 4),
        "checkpoint": near.flatmap(lambda n: st.lists(_MODE, min_size=n, max_size=n)),
        "placement": st.one_of(past, near.flatmap(lambda n: st.lists(index, min_size=n, max_size=n))),
        "deferred_batch_norm": st.booleans(),
        "pin_memory": st.booleans(),
        "engine": st.just("local"),
    }


_PINNED = st.sampled_from(
    [
        ["stages"],
        ["balance"],
        ["stages", "placement"],
        ["balance", "placement"],
        ["stages", "balance_by"],
        ["balance", "checkpoint"],
    ]
)


def _modes_of(stages: int) -> st.SearchStrategy:
    """One mode per stage, all different where there are enough modes (a mix shows a mode mixed up)."""
    return st.lists(_MODE, min_size=stages, max_size=stages, unique=stages <= len(MODES))


@st.composite
def local_cases(draw: Any) -> Tuple[Dict[str, Any], int, int]:
    """(keyword settings, the toy's layer count, CPU devices): settings that fit the model,
    then a few fields changed to another well-typed value (which may not fit) or an invalid one."""
    layers, devices = draw(st.integers(2, 6)), draw(st.integers(1, 2))
    stages = draw(st.integers(1, layers))
    fitting = {
        "stages": stages,
        "balance": draw(_split(layers, stages)),
        "balance_by": draw(st.sampled_from(BALANCE_BY)),  # time, memory: only with a balance (no profiling)
        "chunks": draw(st.integers(1, BATCH + 4)),
        "checkpoint": draw(st.one_of(_MODE, _modes_of(stages))),
        "placement": draw(st.lists(st.integers(0, devices - 1), min_size=stages, max_size=stages)),
        "deferred_batch_norm": draw(st.booleans()),
        "pin_memory": draw(st.booleans()),
        "engine": "local",
    }
    # Without stages or balance, the stage count is one per device (capped by the layers).
    pinned = draw(_PINNED)
    others = draw(st.lists(st.sampled_from([k for k in fitting if k not in pinned]), unique=True, max_size=5))
    kw = {k: fitting[k] for k in [*pinned, *others]}
    for k in list(kw):
        change = draw(_one_in(8, "other", "other", "bad"))
        if change == "bad":
            kw[k] = draw(st.sampled_from(list(_BAD_LOCAL[k])))
        elif change == "other":
            kw[k] = draw(_other_local(stages, devices, layers)[k])
    if draw(_one_in(10, "add")) == "add":  # a distributed-only setting, refused by the local engine
        kw.update(draw(st.sampled_from([{"schedule": "gpipe"}, {"dp": 1}, {"virtual_stages": 1}])))
    if draw(_one_in(10, "add")) == "add":  # a misspelt setting
        kw.update(draw(st.sampled_from([{"chunk": 4}, {"checkpoints": "always"}, {"device": 0}])))
    return kw, layers, devices


def _expected_warning(kw: Dict[str, Any]) -> bool:
    """torch.chunk cuts a batch into pieces of ceil(n / chunks): fewer than chunks pieces warn."""
    chunks = kw.get("chunks", 1)
    return math.ceil(BATCH / math.ceil(BATCH / chunks)) < chunks


@fuzz(examples=200)
@given(case=local_cases())
def test_local_settings_fail_cleanly_before_a_step_or_train_one(case):
    kw, layers, devices = case
    assume(not awaiting_fix(kw))
    early = settings_problems(kw)
    if early:
        event("refused by PipelineStrategy(...)")
        with pytest.raises(PipeckptConfigError) as error:
            PipelineStrategy(**kw)
        assert_names_one_of(error.value, early)
        return
    strategy = PipelineStrategy(**kw)
    module = CountingToy(depth=layers)
    late = model_problems(kw, layers=layers, devices=devices)
    if late:
        event("refused at fit's set-up")
        with pytest.raises(PipeckptConfigError) as error:
            fit(module, strategy, steps=1, devices=devices)
        assert_names_one_of(error.value, late)
        assert module.steps == 0
        return
    event("trained one step")
    before = params(module)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", PipeckptWarning)
        trainer = fit(module, strategy, steps=1, devices=devices)
    assert any(issubclass(w.category, PipeckptWarning) for w in seen) == _expected_warning(kw)
    assert (trainer.global_step, module.steps) == (1, 1)
    after = params(module)
    assert all(not torch.equal(before[k], after[k]) for k in before), "a parameter did not train"
    for name, value in kw.items():  # taken as given (a tuple as its list)
        assert getattr(strategy.settings, name) == (list(value) if isinstance(value, tuple) else value)
    plan = strategy.plan
    assert plan is not None and sum(plan.balance) == layers
    assert plan.stages == local_stage_count(kw, layers=layers, devices=devices)
    if kw.get("balance") is not None:
        assert list(plan.balance) == list(kw["balance"])
    modes = _mode_names(kw.get("checkpoint", "except_last")) or []
    assert [m.name for m in plan.modes] == (modes * plan.stages if len(modes) == 1 else modes)


# -- 1b. Python settings, distributed engine: validated when the Trainer is built -----------------

_SCHEDULE_NAMES = [
    None,
    "gpipe",
    "GPipe",
    "1f1b",
    "1F1B",
    "interleaved_1f1b",
    "Interleaved1F1B",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "ZBVZeroBubble",
    "dual_pipe_v",
    "DualPipeV",
]
_BAD_DISTRIBUTED: Dict[str, Sequence[Any]] = {
    **_BAD_LOCAL,
    "placement": [[0, 1], [0]],
    "schedule": ["zigzag", "", "PipelineScheduleSingle", "pipeline_schedule_multi", 1, ["gpipe"]],
    "dp": [0, -1, True, 1.5, "2"],
    "virtual_stages": [0, True, "2"],
    "timeout": [0, -1.0, True, "60", math.nan, math.inf, 1e300],
}


_OTHER_DISTRIBUTED: Dict[str, st.SearchStrategy] = {  # well-typed values that may not fit the world
    "stages": st.integers(1, 8),
    "dp": st.integers(1, 4),
    "chunks": st.integers(1, 8),
    "virtual_stages": st.integers(1, 3),
    "schedule": st.sampled_from(_SCHEDULE_NAMES),
    "checkpoint": st.one_of(_MODE, _MODE_LIST),
    "timeout": st.sampled_from([1, 0.25, 3600.0]),
    "deferred_batch_norm": st.booleans(),
}


@st.composite
def distributed_cases(draw: Any) -> Tuple[Dict[str, Any], int, int]:
    """(keyword settings, devices, nodes): a setting that fits the world, then a few fields
    changed to another well-typed value (which may not fit) or to an invalid one."""
    devices, nodes = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    world = devices * nodes
    name = draw(st.sampled_from(_SCHEDULE_NAMES))
    kind = _schedule(name)
    assert kind is not None
    v = 2 if kind.v_shape else draw(st.integers(1, 3)) if kind.looped else 1
    dp = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    pp = world // dp
    fitting = {
        "schedule": name,
        "virtual_stages": v,
        "dp": dp,
        "stages": pp * v,
        "chunks": draw(st.integers(pp * v, 3 * pp * v)),
        "checkpoint": draw(_MODE),
        "timeout": draw(st.one_of(st.integers(1, 3600), st.floats(0.001, 1e6))),
        "deferred_batch_norm": draw(st.booleans()),
    }
    needed = ["schedule", "virtual_stages"] if v > 1 or kind.v_shape else []
    needed = list(dict.fromkeys(needed))
    optional = [k for k in fitting if k not in needed]
    kw = {k: fitting[k] for k in needed + draw(st.lists(st.sampled_from(optional), unique=True))}
    for k in list(kw):
        change = draw(_one_in(6, "other", "bad"))
        if change == "bad":
            kw[k] = draw(st.sampled_from(list(_BAD_DISTRIBUTED[k])))
        elif change == "other":
            kw[k] = draw(_OTHER_DISTRIBUTED[k])
    if draw(_one_in(10, "placement")) == "placement":
        kw["placement"] = draw(st.sampled_from(list(_BAD_DISTRIBUTED["placement"])))
    kw["engine"] = "distributed"
    return kw, devices, nodes


def _trainer(strategy: PipelineStrategy, devices: int, nodes: int) -> L.Trainer:
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, num_nodes=nodes, logger=False, max_steps=1
    )


@fuzz(examples=600)
@given(case=distributed_cases())
def test_distributed_settings_fail_cleanly_when_the_trainer_is_built(case):
    kw, devices, nodes = case
    assume(not awaiting_fix(kw))
    early = settings_problems(kw)
    if early:
        event("refused by PipelineStrategy(...)")
        with pytest.raises(PipeckptConfigError) as error:
            PipelineStrategy(**kw)
        assert_names_one_of(error.value, early)
        return
    strategy = PipelineStrategy(**kw)
    world = devices * nodes
    late = world_problems(kw, world)
    if late:
        event("refused by Trainer(...)")
        with pytest.raises(PipeckptConfigError) as error:
            _trainer(strategy, devices, nodes)
        assert_names_one_of(error.value, late)
        return
    event("Trainer built")
    _trainer(strategy, devices, nodes)
    topology = strategy.engine.topology  # type: ignore[attr-defined]
    assert topology.pp * topology.dp == world
    assert topology.virtual_stages == (kw.get("virtual_stages") or 1)
    stages = len(kw["balance"]) if kw.get("balance") is not None else kw.get("stages")
    pp = world // kw["dp"] if kw.get("dp") is not None else world  # when the stages do not say
    assert topology.stages == (stages if stages is not None else pp * topology.virtual_stages)
    if kw.get("dp") is not None:
        assert topology.dp == kw["dp"]


# -- 2. Hydra overrides, composed in-process and built as train.py builds them --------------------

HYDRA = object()  # the schema's type refuses the value: Hydra's own error at compose time

# Per key: (override value, what the strategy receives, or HYDRA). How OmegaConf coerces each
# value for its schema type (int, Optional[List[int]], bool, Optional[float], Any) is part of the spec.
OVERRIDES: Dict[str, List[Tuple[str, Any]]] = {
    "strategy.stages": [
        ("null", None),
        ("1", 1),
        ("3", 3),
        ("0", 0),
        ("-1", -1),
        ("2.5", HYDRA),
        ("two", HYDRA),
    ],
    "strategy.balance": [
        ("null", None),
        ("[1,1]", [1, 1]),
        ("[2,1,1]", [2, 1, 1]),
        ("[]", []),
        ("[0,2]", [0, 2]),
        ("[1,x]", HYDRA),
        ("3", HYDRA),
    ],
    "strategy.balance_by": [("params", "params"), ("time", "time"), ("luck", "luck"), ("null", HYDRA)],
    "strategy.chunks": [
        ("1", 1),
        ("2", 2),
        ("8", 8),
        ("'3'", 3),
        ("0", 0),
        ("-3", -3),
        ("2.0", HYDRA),
        ("true", HYDRA),
        ("null", HYDRA),
    ],
    "ckpt.modes": [
        ("never", "never"),
        ("always", "always"),
        ("offload", "offload"),
        ("[always,never]", ["always", "never"]),
        ("[always]", ["always"]),
        ("sometimes", "sometimes"),
        ("[always,sometimes]", ["always", "sometimes"]),
        ("null", None),
        ("3", 3),
    ],
    "strategy.placement": [
        ("null", None),
        ("[0,0]", [0, 0]),
        ("[0]", [0]),
        ("[-1,0]", [-1, 0]),
        ("[a]", HYDRA),
    ],
    "strategy.deferred_batch_norm": [("true", True), ("false", False), ("abc", HYDRA)],
    "strategy.pin_memory": [("false", False), ("true", True), ("maybe", HYDRA)],
    "strategy.engine": [
        ("local", "local"),
        ("distributed", "distributed"),
        ("remote", "remote"),
        ("5", "5"),
        ("null", HYDRA),
        ("[local]", HYDRA),
    ],
    "strategy.schedule": [
        ("null", None),
        ("gpipe", "gpipe"),
        ("1f1b", "1f1b"),
        ("interleaved_1f1b", "interleaved_1f1b"),
        ("zbv_zero_bubble", "zbv_zero_bubble"),
        ("zigzag", "zigzag"),
        ("[gpipe]", HYDRA),
    ],
    "strategy.dp": [("null", None), ("1", 1), ("2", 2), ("0", 0), ("1.5", HYDRA)],
    "strategy.virtual_stages": [("null", None), ("1", 1), ("2", 2), ("0", 0), ("x", HYDRA)],
    "strategy.timeout": [
        ("null", None),
        ("30", 30.0),
        ("0.5", 0.5),
        ("0", 0.0),
        ("-1", -1.0),
        ("nan", math.nan),
        ("soon", HYDRA),
    ],
    "trainer.devices": [("1", 1), ("2", 2), ("4", 4)],
    "strategy.chunk": [("4", HYDRA)],  # a misspelt key: not in the schema
    "+strategy.chunk": [("4", 4)],  # added past the schema: the strategy refuses it
}
# What conf/strategy/pipe.yaml and conf/ckpt/except_last.yaml give the strategy.
PIPE_YAML = {"stages": 2, "chunks": 4, "checkpoint": "except_last", "pin_memory": True}


@st.composite
def override_cases(draw: Any) -> List[Tuple[str, str, Any]]:
    keys = draw(st.lists(st.sampled_from(list(OVERRIDES)), unique=True, max_size=5))
    return [(key, *draw(st.sampled_from(OVERRIDES[key]))) for key in keys]


def build_like_train(cfg: Any) -> Dict[str, Any]:
    """What train.train() builds from a config, in its order, short of training."""
    data, model = instantiate(cfg.data), instantiate(cfg.model)
    strategy = instantiate(cfg.strategy, _convert_="all")
    callbacks = [instantiate(c) for c in (cfg.callbacks or {}).values()]
    logger = instantiate(cfg.logger) if cfg.logger else False
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks)
    return {"data": data, "model": model, "strategy": strategy, "trainer": trainer}


@fuzz(examples=60)
@given(case=override_cases())
def test_hydra_overrides_fail_at_compose_or_cleanly_at_build_or_build(tmp_path, case):
    overrides = [f"{key}={text}" for key, text, _ in case]
    kw = dict(PIPE_YAML)
    kw.update({key.split(".")[-1].replace("modes", "checkpoint"): value for key, _, value in case})
    devices = kw.pop("devices", 1)  # trainer.devices: auto is one CPU
    assume(not awaiting_fix(kw))
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        if any(value is HYDRA for _, _, value in case):
            event("refused by Hydra at compose")
            with pytest.raises(ConfigCompositionException):
                compose("train", overrides=[f"output_dir={tmp_path}", *overrides])
            return
        cfg = compose("train", overrides=[f"output_dir={tmp_path}", *overrides])
    early = settings_problems(kw)
    late = world_problems(kw, devices) if not early and kw.get("engine") == "distributed" else []
    if early or late:
        event("refused at build")
        with pytest.raises(Exception) as error:
            build_like_train(cfg)
        mistake = train._config_error(error.value)  # what train.py prints as "Configuration error: ..."
        assert mistake is not None, repr(error.value)
        assert_names_one_of(mistake, early or late)
        return
    event("built")
    objects = build_like_train(cfg)
    assert isinstance(objects["trainer"], L.Trainer)
    assert objects["trainer"].strategy is objects["strategy"]
    got = objects["strategy"].settings
    for name, value in kw.items():
        assert getattr(got, name) == value, name
