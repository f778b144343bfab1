"""Config fuzzing, Python settings under the local engine (issue 11, item 6): random strategy
settings, valid and invalid values of every field, wrong types, misspelt keys and distributed-only
settings, each of which fails with one clean :class:`~pipeckpt.PipeckptConfigError` before any
training step (naming a broken setting), or trains one step of the toy module, every parameter
changed and the plan as the settings asked.

The outcome each example must have comes from the reference model in :mod:`support.config_fuzz`.
"""

import math
import warnings
from typing import Any, Dict, Tuple

import pytest
import torch
from hypothesis import assume, event, given
from hypothesis import strategies as st
from support.config_fuzz import BAD_LOCAL as _BAD_LOCAL
from support.config_fuzz import (
    BALANCE_BY,
    BATCH,
    MODES,
    CountingToy,
    assert_names_one_of,
    awaiting_fix,
    fuzz,
    local_stage_count,
    model_problems,
    refused_by_the_strategy,
)
from support.config_fuzz import MODE as _MODE
from support.config_fuzz import mode_names as _mode_names
from support.config_fuzz import one_in as _one_in
from support.toy import fit, params

from pipeckpt import PipeckptConfigError, PipeckptWarning, PipelineStrategy


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
    if refused_by_the_strategy(kw):
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
