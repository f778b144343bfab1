"""Outputs a model records inside its layers cross the processes with their gradients: Mixtral and
Qwen3-MoE (tiny random configs) with the routers' load-balancing loss on, ``self.model(**batch).loss``,
2 processes (gloo on CPU, tests/engines/distributed/recorded_outputs_worker.py), chunks 2. The first
stage's router logits travel to the last stage beside its layers' outputs, so the loss counts every
layer's (it counted only the last stage's) and their gradients come back: parameters, the reported
step losses and the routers' gradients equal the unpipelined per-micro-batch reference within 1e-5.
The local engine's are in tests/boundaries/test_recorded_outputs.py."""

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch
from test_distributed_pytree import _state
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
from support.hf_models import batches
from support.moe_models import MoEModule

WORKER = Path(__file__).resolve().parent / "recorded_outputs_worker.py"
START_S = 540  # four trainings on a loaded 2-core machine
STEPS = 3
TWO = dict(balance=[2, 2], chunks=2, timeout=60)
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


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    runs = [dict(run, steps=STEPS) for run in RUNS]
    yield ranks.launch(WORKER, 2, runs, tmp_path_factory.mktemp("recorded"), within_s=START_S)


_REFERENCES: Dict[str, MoEModule] = {}


def reference(model: str) -> MoEModule:
    if model not in _REFERENCES:
        module = MoEModule(model, chunks=2)
        ranks.quiet_trainer("auto", 1, max_steps=STEPS).fit(
            module, DataLoader(batches(STEPS), batch_size=None)
        )
        _REFERENCES[model] = module
    return _REFERENCES[model]


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_moe_with_router_loss_trains_across_two_processes_as_the_per_microbatch_reference(two_processes, run):
    want = reference(run["model"])
    got = _state(two_processes / f"{run['name']}.ckpt")["state_dict"]
    expected = {k: v.detach() for k, v in want.state_dict().items()}
    assert sorted(got) == sorted(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-5, msg=k)
    seen = [json.loads((two_processes / f"{run['name']}.rank{r}.json").read_text()) for r in range(2)]
    assert seen[1]["step_losses"] == pytest.approx(want.step_losses, rel=1e-5, abs=1e-6)
    routers = {**seen[0]["routers"], **seen[1]["routers"]}  # each rank holds its stage's
    assert sorted(routers) == sorted(want.router_grads) and len(routers) == 4
    for k, g in want.router_grads.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(torch.tensor(routers[k]), g, rtol=1e-5, atol=1e-7, msg=k)
