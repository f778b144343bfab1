"""Config fuzzing, Python settings under the distributed engine (issue 11, item 6): random settings
are validated when the Trainer is built (no process is launched here). Each fails with one clean
:class:`~pipeckpt.PipeckptConfigError` naming a broken setting, at ``PipelineStrategy(...)`` for a
rule of the settings alone or at ``Trainer(...)`` for one of the world (pp x dp processes, the
schedule's micro-batches), or builds a Trainer whose topology is what the settings and world say.

The outcome each example must have comes from the reference model in :mod:`support.config_fuzz`.
"""

import math
from typing import Any, Dict, Sequence, Tuple

import lightning as L
import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st
from support.config_fuzz import BAD_LOCAL as _BAD_LOCAL
from support.config_fuzz import MODE as _MODE
from support.config_fuzz import MODE_LIST as _MODE_LIST
from support.config_fuzz import (
    assert_names_one_of,
    awaiting_fix,
    fuzz,
    refused_by_the_strategy,
    world_problems,
)
from support.config_fuzz import one_in as _one_in
from support.config_fuzz import schedule_kind as _schedule

from pipeckpt import PipeckptConfigError, PipelineStrategy

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
    if refused_by_the_strategy(kw):
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
