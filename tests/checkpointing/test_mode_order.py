"""`except_last` follows the op order of the schedule that runs (checkpointing.order): a stage keeps the
micro-batch whose backward comes first on it, and any whose backward follows its own forward at
once; under the local engine that is the last micro-batch, under torch's GPipe and 1F1B micro-batch
0, and on 1F1B's last stage all of them. Slow tests run 2 gloo processes and count what recomputes."""

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from support.toy import assert_bitwise_equal, toy_layers
from test_distributed_engine import _state, launch  # noqa: F401  (launch: the module's fixture)

from pipeckpt._compat import schedule_op_order
from pipeckpt.checkpointing.modes import parse_mode
from pipeckpt.checkpointing.order import gpipe_order, kept, local_order, one_f_one_b_order
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan
from pipeckpt.stages.stage import Stage

CPU = [torch.device("cpu")]


def test_the_local_engine_keeps_the_last_microbatch():
    assert kept(local_order(0, 4), 0) == {3}


def test_torch_gpipe_keeps_microbatch_zero_whose_backward_comes_first():
    assert kept(gpipe_order(1, 4), 1) == {0}


def test_1f1b_keeps_microbatch_zero_on_early_stages_and_every_microbatch_on_the_last():
    assert [kept(one_f_one_b_order(j, 4, 6), j) for j in range(4)] == [{0}, {0}, {0}, set(range(6))]


def test_a_looped_rank_judges_adjacency_over_all_its_stages_ops():
    # stage 1's F0 and B0 are adjacent; stage 0's B0 comes after stage 0's F1: only B0 is first
    order = [(0, "F", 0), (1, "F", 0), (1, "B", 0), (0, "F", 1), (0, "B", 0), (1, "F", 1), (1, "B", 1)]
    assert (kept(order, 0), kept(order, 1)) == ({0}, {0, 1})


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 4), (4, 8)])
def test_the_derived_orders_run_the_ops_torchs_schedule_ir_names(stages, microbatches):
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    gpipe = schedule_op_order(ScheduleGPipe, stages=stages, microbatches=microbatches)
    one_f_one_b = schedule_op_order(Schedule1F1B, stages=stages, microbatches=microbatches)
    assert gpipe is not None and one_f_one_b is not None
    for j in range(stages):
        assert [(k, i) for _, k, i in gpipe_order(j, microbatches)] == gpipe[j]
    # torch's 1F1B IR omits micro-batch 0's forward on the last rank (its runner does not): compare the rest
    for j in range(stages - 1):
        assert [(k, i) for _, k, i in one_f_one_b_order(j, stages, microbatches)] == one_f_one_b[j]


def stage_under(mode: str, order: Any) -> Stage:
    torch.manual_seed(0)
    index = order[0][0] if order else 1
    stage = Stage(toy_layers(depth=3), index=index, mode=parse_mode(mode), device=CPU[0])
    stage.begin_step(4, order=order)
    for _ in range(4):
        stage(torch.randn(2, 8))
    return stage


@pytest.mark.parametrize(
    "mode, order, checkpointed, recomputes",
    [
        ("except_last", None, [0, 1, 2], 3),  # the local engine's order by default
        ("except_last", gpipe_order(1, 4), [1, 2, 3], 3),
        ("except_last:1", one_f_one_b_order(1, 2, 4), [], 0),  # 1F1B's last stage
        ("except_last+selective", one_f_one_b_order(0, 2, 4), [1, 2, 3], 0),  # SAC: no _Recompute runs
        ("always", one_f_one_b_order(1, 2, 4), [0, 1, 2, 3], 4),  # always means always
    ],
)
def test_a_stage_checkpoints_what_its_order_does_not_keep(mode, order, checkpointed, recomputes):
    stage = stage_under(mode, order)
    assert stage.checkpointed == checkpointed
    assert stage.recomputes_per_step(4, order=order) == recomputes * (3 if mode.endswith(":1") else 1)


def test_the_local_pipeline_keeps_the_microbatch_it_backwards_first():
    seq = toy_layers(depth=6)
    engine = LocalPipeline(seq, plan(seq, devices=CPU, balance=[3, 3], checkpoint="except_last"), chunks=4)
    engine.forward(torch.randn(8, 8)).sum().backward()
    assert [s.checkpointed for s in engine.stages] == [[0, 1, 2], [0, 1, 2]]


# -- two processes -----------------------------------------------------------------------------

STEPS = 2
MODES: Dict[str, Any] = {
    "never": "never",
    "except_last": "except_last",
    "granular": ["always:1", "except_last:2"],
    "selective": ["except_last+selective:1", "selective"],
}
# The last step's checkpointed micro-batches per stage, and each stage's runs over all steps
# (4 forwards per step plus one per recomputed micro-batch).
EXPECTED: Dict[str, Dict[str, Any]] = {
    "gpipe": {
        "never": ({"0": [], "1": []}, {"0": 4, "1": 4}),
        "except_last": ({"0": [1, 2, 3], "1": [1, 2, 3]}, {"0": 7, "1": 7}),
        "granular": ({"0": [0, 1, 2, 3], "1": [1, 2, 3]}, {"0": 8, "1": 7}),
        "selective": ({"0": [1, 2, 3], "1": [0, 1, 2, 3]}, {"0": 7, "1": 8}),
    },
    "1f1b": {
        "never": ({"0": [], "1": []}, {"0": 4, "1": 4}),
        "except_last": ({"0": [1, 2, 3], "1": []}, {"0": 7, "1": 4}),
        "granular": ({"0": [0, 1, 2, 3], "1": []}, {"0": 8, "1": 4}),
        "selective": ({"0": [1, 2, 3], "1": [0, 1, 2, 3]}, {"0": 7, "1": 8}),
    },
}


@pytest.fixture(scope="module")
def two_processes(launch) -> Path:  # noqa: F811
    runs: List[Dict[str, Any]] = [
        dict(
            name=f"{schedule}_{name}",
            strategy=dict(balance=[3, 3], chunks=4, schedule=schedule, checkpoint=modes),
            dropout=0.3,
            steps=STEPS,
        )
        for schedule in EXPECTED
        for name, modes in MODES.items()
    ]
    return launch(2, runs)


def _seen(out: Path, run: str, key: str) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    for rank in range(2):
        seen.update(json.loads((out / f"{run}.rank{rank}.json").read_text())[key])
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(EXPECTED))
@pytest.mark.parametrize("name", list(MODES)[1:])
def test_distributed_modes_train_bitwise_like_never_with_dropout(two_processes, schedule, name):
    got = _state(two_processes / f"{schedule}_{name}.ckpt")["state_dict"]
    assert_bitwise_equal(got, _state(two_processes / f"{schedule}_never.ckpt")["state_dict"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(EXPECTED))
@pytest.mark.parametrize("name", list(MODES))
def test_distributed_stages_recompute_exactly_what_the_schedule_order_does_not_keep(
    two_processes, schedule, name
):
    checkpointed, runs_per_step = EXPECTED[schedule][name]
    assert _seen(two_processes, f"{schedule}_{name}", "checkpointed") == checkpointed
    assert _seen(two_processes, f"{schedule}_{name}", "forward_calls") == {
        k: STEPS * v for k, v in runs_per_step.items()
    }
