"""What the config fuzzers (tests/app/test_config_fuzz_*.py) share: the reference model of the rules
that decides each example's outcome, Hypothesis's settings, the inputs of known bugs, and the values
the Python-settings fuzzers draw from.

Which outcome each example must have is decided by :func:`settings_problems`,
:func:`world_problems` and :func:`model_problems`, a reference model of the rules
written from their documentation (``PipeSettings``' help, the
README, torch's schedule docs), not from the checks' code. When the code and the
model disagree, Hypothesis shrinks the example to a minimal one.

Bugs found this way are kept as minimal ``xfail(strict=True)`` examples
(tests/app/test_config_fuzz_examples.py); the fuzzers skip their inputs (:data:`AWAITING_FIX`)
until the fix lands: then flip the xfail and drop the entry.

Hypothesis runs derandomized (a fixed seed, no example database), so CI sees the
same examples every run; ``max_examples`` keeps each fuzzing file under a minute on 2 cores.
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pipeckpt import PipeckptConfigError
from support.toy import ToyModule

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


def mode_names(v: Any) -> Optional[List[str]]:
    """The modes a ``checkpoint`` value names, or None if it is not a mode name or a list of them."""
    names = [v] if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) else None
    if names is None or not all(isinstance(n, str) and n in MODES for n in names):
        return None
    return names


def schedule_kind(v: Any) -> Optional[Schedule]:
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
        "checkpoint": mode_names(s["checkpoint"]) is None,
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
        kind = schedule_kind(s["schedule"])
        bad["schedule"] = kind is None
        v = s["virtual_stages"] if s["virtual_stages"] is not None else 1
        if kind is not None and not bad["virtual_stages"]:
            if (v > 1 and not kind.looped) or (kind.v_shape and v != 2):
                out.append(Problem("virtual_stages", "settings"))
    return out + [Problem(k, "settings") for k, b in bad.items() if b]


def world_problems(kw: Dict[str, Any], world: int) -> List[Problem]:
    """The distributed engine's topology (pp x dp processes) against the Trainer's world."""
    kind = schedule_kind(kw.get("schedule"))
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
    modes = mode_names(kw.get("checkpoint", "except_last"))
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


# -- known bugs: the inputs the fuzzers skip until they are fixed (tests/app/test_config_fuzz_examples.py) --

AWAITING_FIX: Dict[str, Callable[[Dict[str, Any]], bool]] = {}


def awaiting_fix(kw: Dict[str, Any]) -> bool:
    return any(hit(kw) for hit in AWAITING_FIX.values())


# -- what the Python-settings fuzzers train, and the values they draw ---------------------------


class CountingToy(ToyModule):
    """The toy module, counting the training steps that ran."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return super().training_step(batch, batch_idx)


def one_in(n: int, *rare: str) -> st.SearchStrategy:
    """Each of ``rare`` one time in ``n``, else "keep" (which is also what examples shrink to)."""
    return st.sampled_from(["keep"] * (n - len(rare)) + list(rare))


MODE = st.sampled_from(MODES)
MODE_LIST = st.lists(MODE, min_size=1, max_size=4)
_BAD_MODES = ["sometimes", "ALWAYS", None, 3, {"always": 1}, {"always"}, ["always", "sometimes"], [["never"]]]
BAD_LOCAL: Dict[str, Sequence[Any]] = {
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


def refused_by_the_strategy(kw: Dict[str, Any]) -> bool:
    """Whether the reference model refuses ``kw`` without a model or a world; if so,
    ``PipelineStrategy(**kw)`` has raised, naming one of its problems (checked here)."""
    from hypothesis import event

    from pipeckpt import PipelineStrategy

    early = settings_problems(kw)
    if early:
        event("refused by PipelineStrategy(...)")
        with pytest.raises(PipeckptConfigError) as error:
            PipelineStrategy(**kw)
        assert_names_one_of(error.value, early)
    return bool(early)
