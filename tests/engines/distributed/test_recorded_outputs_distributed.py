"""Outputs a model records inside its layers cross the processes with their gradients: Mixtral and
Qwen3-MoE (tiny random configs) with the routers' load-balancing loss on, ``self.model(**batch).loss``,
2 processes (gloo on CPU, tests/engines/distributed/recorded_outputs_worker.py), chunks 2. The first
stage's router logits travel to the last stage beside its layers' outputs, so the loss counts every
layer's (it counted only the last stage's) and their gradients come back: parameters, the reported
step losses and the routers' gradients equal the unpipelined per-micro-batch reference within 1e-5,
under checkpoint="auto" too (the plan recomputing to fit a budget), and under a looped and two
zero-bubble schedules (two stages per process, four micro-batches, the reference's four).
The local engine's are in tests/boundaries/test_recorded_outputs.py."""

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import support.ranks as ranks
import torch
from test_distributed_pytree import _state
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
from support.hf_models import batches
from support.moe_models import MoEModule

WORKER = Path(__file__).resolve().parent / "recorded_outputs_worker.py"
START_S = 900  # nine trainings on a loaded 2-core machine
STEPS = 3
TWO = dict(balance=[2, 2], chunks=2, timeout=60)
#: Two stages per process (a looped or a zero-bubble schedule): a stage per layer, a micro-batch per stage.
FOUR = dict(balance=[1, 1, 1, 1], chunks=4, virtual_stages=2, timeout=60)
#: Never everywhere is predicted at 0.7 and 0.6 MiB for the two processes' stages; this budget makes
#: auto recompute (both stages, always under 1f1b and except_last under gpipe, as chosen today).
AUTO_BUDGET = "640KiB"
RUNS: List[Dict[str, Any]] = [
    dict(
        name=f"{model}_{mode}_{schedule}", model=model, strategy=dict(TWO, schedule=schedule, checkpoint=mode)
    )
    for model, mode, schedule in [
        ("mixtral", "never", "1f1b"),
        ("mixtral", "always", "gpipe"),
        ("qwen3_moe", "except_last", "1f1b"),
        ("qwen3_moe", "selective", "gpipe"),
    ]
]
AUTO_RUNS: List[Dict[str, Any]] = [
    dict(
        name=f"{model}_auto_{schedule}",
        model=model,
        strategy=dict(TWO, schedule=schedule, checkpoint="auto", memory_budget=AUTO_BUDGET),
    )
    for model, schedule in [("mixtral", "1f1b"), ("qwen3_moe", "gpipe")]
]
SCHEDULE_RUNS: List[Dict[str, Any]] = [
    dict(
        name=f"{model}_{mode}_{schedule}",
        model=model,
        strategy=dict(FOUR, schedule=schedule, checkpoint=mode),
    )
    for model, mode, schedule in [
        ("mixtral", "never", "interleaved_1f1b"),
        ("mixtral", "always", "zbv_zero_bubble"),
        ("mixtral", "selective", "interleaved_zero_bubble"),
    ]
]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    runs = [dict(run, steps=STEPS) for run in RUNS + AUTO_RUNS + SCHEDULE_RUNS]
    yield ranks.launch(WORKER, 2, runs, tmp_path_factory.mktemp("recorded"), within_s=START_S)


_REFERENCES: Dict[Tuple[str, int], MoEModule] = {}


def reference(model: str, chunks: int) -> MoEModule:
    if (model, chunks) not in _REFERENCES:
        module = MoEModule(model, chunks=chunks)
        ranks.quiet_trainer("auto", 1, max_steps=STEPS).fit(
            module, DataLoader(batches(STEPS), batch_size=None)
        )
        _REFERENCES[model, chunks] = module
    return _REFERENCES[model, chunks]


def assert_trains_as_the_reference(out: Path, run: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The run's parameters, its reported step losses and the routers' first gradients against the
    unpipelined per-micro-batch reference's; returns what each rank wrote."""
    want = reference(run["model"], run["strategy"]["chunks"])
    got = _state(out / f"{run['name']}.ckpt")["state_dict"]
    expected = {k: v.detach() for k, v in want.state_dict().items()}
    assert sorted(got) == sorted(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-5, msg=k)
    seen = [json.loads((out / f"{run['name']}.rank{r}.json").read_text()) for r in range(2)]
    for s in seen:  # every process reports the step's loss
        assert s["step_losses"] == pytest.approx(want.step_losses, rel=1e-5, abs=1e-6)
    routers = {**seen[0]["routers"], **seen[1]["routers"]}  # each rank holds its stages'
    assert sorted(routers) == sorted(want.router_grads) and len(routers) == 4
    for k, g in want.router_grads.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(torch.tensor(routers[k]), g, rtol=1e-5, atol=1e-7, msg=k)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_moe_with_router_loss_trains_across_two_processes_as_the_per_microbatch_reference(two_processes, run):
    assert_trains_as_the_reference(two_processes, run)


@pytest.mark.slow
@pytest.mark.parametrize("run", AUTO_RUNS, ids=[r["name"] for r in AUTO_RUNS])
def test_auto_plans_and_trains_moe_with_router_loss_across_two_processes(two_processes, run):
    """The profile replays the router logits the layers recorded (HF's loss raised IndexError on
    none); the plan fits the budget by recomputing, and trains as the reference."""
    seen = assert_trains_as_the_reference(two_processes, run)
    assert any(seen[0]["checkpoints"])  # the budget made the plan recompute


@pytest.mark.slow
@pytest.mark.parametrize("run", SCHEDULE_RUNS, ids=[r["name"] for r in SCHEDULE_RUNS])
def test_moe_with_router_loss_trains_under_looped_and_zero_bubble_schedules(two_processes, run):
    """Two stages per process (Mixtral's 4 layers, one a stage): the first stage's router logits go
    through three sends (and back with their gradients), under a split backward for zero bubble."""
    assert_trains_as_the_reference(two_processes, run)
