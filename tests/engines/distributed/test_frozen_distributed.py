"""``checkpoint="auto"`` on models with frozen parameters under the distributed engine (2 gloo processes,
tests/engines/distributed/distributed_frozen_worker.py): the toy Sequential with a frozen block in
each stage, and PEFT LoRA on a tiny Llama with the pipeline's layer list under ``get_peft_model``.
Each plans (a budget that makes its first stage recompute), trains, and equals the unpipelined module
within 1e-5, with only the trained parameters changed. The local engine's are in
tests/memory/test_frozen.py."""

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch
from support.frozen_models import LoraLlama, frozen_toy, lora_loader, trained_names
from support.toy import params, toy_loader
from test_distributed_pytree import _state

WORKER = Path(__file__).resolve().parent / "distributed_frozen_worker.py"
START_S = 480  # two trainings on a loaded 2-core machine
ONE_F_ONE_B = dict(stages=2, chunks=2, schedule="1f1b")
#: Predicted under 1F1B: the toy's stages peak at 11920 and 10624 bytes under never, the first at
#: 11408 at least (selective); LoRA's at 489 KiB and 344 KiB, the first at 318 KiB under always.
RUNS: List[Dict[str, Any]] = [
    dict(name="toy", model="toy", steps=3, strategy=dict(ONE_F_ONE_B, memory_budget=12000)),
    dict(name="lora", model="lora", steps=2, strategy=dict(ONE_F_ONE_B, memory_budget="450KiB")),
]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    pytest.importorskip("peft")
    yield ranks.launch(WORKER, 2, RUNS, tmp_path_factory.mktemp("frozen"), within_s=START_S)


def _unpipelined(run: Dict[str, Any]) -> Dict[str, Any]:
    module, loader = (frozen_toy(), toy_loader()) if run["model"] == "toy" else (LoraLlama(), lora_loader())
    torch.manual_seed(123)
    ranks.quiet_trainer("auto", 1, max_steps=run["steps"]).fit(module, loader)
    return params(module)


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_auto_trains_frozen_parameters_across_two_processes_like_the_unpipelined_module(two_processes, run):
    built = json.loads((two_processes / f"{run['name']}.json").read_text())["modes"]
    assert built[0] != "never"  # the budget made the first stage recompute
    got = _state(two_processes / f"{run['name']}.ckpt")["state_dict"]
    module = frozen_toy() if run["model"] == "toy" else LoraLlama()
    before, reference = params(module), _unpipelined(run)
    assert sorted(got) == sorted(reference)
    assert max((got[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5
    changed = {k for k in reference if not torch.equal(got[k], before[k])}
    assert changed == trained_names(module)
