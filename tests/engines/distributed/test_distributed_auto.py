"""checkpoint='auto' under memory_budget with the distributed engine: planned once, on rank 0, built
by every rank, each rank within the budget; refusals before any work.

The multi-process tests run tests/engines/distributed/distributed_auto_worker.py on two gloo ranks (one
torch thread
each): a 7-layer GPT (d 128, seq 64, batch 16, 4 micro-batches, AdamW) cut into two stages.
"""

import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import support.ranks as ranks
import torch
from distributed_auto_worker import build
from distributed_fsdp_worker import build as fsdp_build
from distributed_fsdp_worker import replica_rows
from support import forkserver
from test_distributed_fsdp import AUTO as fsdp_auto_run

from pipeckpt import PipelineStrategy
from pipeckpt._errors import PipeckptConfigError
from pipeckpt.app.models import MLP
from pipeckpt.engines.base import World
from pipeckpt.engines.distributed import DistributedEngine
from pipeckpt.engines.distributed.auto_plan import adopt
from pipeckpt.engines.distributed.schedules import lookup
from pipeckpt.engines.distributed.topology import Topology
from pipeckpt.memory.budget import fitted_optimizer, resolve_auto
from pipeckpt.memory.sharding import Layout
from pipeckpt.settings import PipeSettings
from pipeckpt.sizes import MiB

WORKER = Path(__file__).resolve().parent / "distributed_auto_worker.py"
START_S = 240  # processes started on a loaded 2-core machine (the run itself takes ~15 s)

#: 1F1B on two ranks. Stage 0 holds two micro-batches at its peak (20.7 MiB predicted under
#: "never"), stage 1 one (14.6 MiB): 17 MiB makes stage 0 checkpoint and lets stage 1 keep
#: everything, so the ranks' plans differ.
FITS: Dict[str, Any] = {
    "name": "fits",
    "strategy": {
        "stages": 2,
        "chunks": 4,
        "schedule": "1f1b",
        "memory_budget": "17MiB",
        "memory_optimizer": "adamw",
    },
}
#: Below the smallest feasible budget of any mode (about 13 MiB: parameters, AdamW state and one
#: layer's activations at a time on the larger stage).
INFEASIBLE: Dict[str, Any] = {
    "name": "infeasible",
    "strategy": {**FITS["strategy"], "schedule": "gpipe", "memory_budget": "4MiB"},
}


def _seen(out: Path, name: str) -> List[Dict[str, Any]]:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("distauto")
    return ranks.launch(WORKER, 2, [FITS], out, within_s=START_S)


def test_every_rank_builds_the_plan_rank_zero_chose(fits: Path) -> None:
    zero, one = _seen(fits, "fits")
    assert zero["chosen"] == one["chosen"]
    assert zero["built"] == zero["chosen"] and one["built"] == one["chosen"]
    assert (zero["stages"], one["stages"]) == ([0], [1])


def test_the_plan_is_resolve_autos_in_one_process_given_rank_zeros_profiles(fits: Path) -> None:
    profiles = torch.load(fits / "fits.profiles.pt", weights_only=False)
    model, data = build()
    data.setup("fit")
    tokens, _ = next(iter(data.train_dataloader()))
    settings = PipeSettings(engine="distributed", checkpoint="auto", **FITS["strategy"])
    alone = resolve_auto(
        settings, model.layers, devices=[torch.device("cpu")] * 2, batch=tokens, profiles=profiles
    )
    expected = {
        "modes": [m.name for m in alone.choice.modes],
        "chunks": alone.choice.chunks,
        "balance": list(alone.choice.balance),
    }
    assert [seen["chosen"] for seen in _seen(fits, "fits")] == [expected, expected]


def test_the_budget_binds_rank_zero_checkpoints_and_rank_one_does_not(fits: Path) -> None:
    modes = _seen(fits, "fits")[0]["chosen"]["modes"]
    assert modes[0] != "never" and modes[1] == "never", modes


def test_each_ranks_measured_peak_stays_within_the_budget(fits: Path) -> None:
    for seen in _seen(fits, "fits"):
        assert seen["steps"] == 2
        held = seen["window_peak"] + seen["params"] + seen["optimizer"]
        assert seen["window_peak"] > 0 and seen["optimizer"] > 0
        assert held <= seen["budget"], (
            f"rank {seen['rank']}: {held / MiB:.2f} MiB measured over the {seen['budget'] / MiB:.2f} MiB "
            f"budget (predicted {seen['predicted'][0] / MiB:.2f} MiB)"
        )


def test_an_infeasible_budget_stops_every_rank_with_rank_zeros_error(tmp_path: Path) -> None:
    procs = ranks.start(WORKER, 2, [INFEASIBLE], tmp_path)
    began = time.time()
    try:
        for p in procs:
            p.wait(timeout=max(1, START_S - (time.time() - began)))
    except Exception:
        pytest.fail(f"the ranks did not stop within {START_S}s:\n{ranks.logs(tmp_path, 2)}")
    finally:
        ranks.stop(procs)
    logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(2)]
    assert all(p.returncode not in (0, None) for p in procs), ranks.logs(tmp_path, 2)
    said = r"the smallest feasible budget is [\d.]+ MiB \((\d+) bytes\)"
    smallest = [re.findall(said, log) for log in logs]
    assert smallest[0] and smallest[1] == smallest[0], ranks.logs(tmp_path, 2)
    assert int(smallest[0][0]) > 4 * MiB
    for log in logs:
        assert "PipeckptConfigError: memory budget 4.0 MiB" in log
        assert "failed in a collective" not in log and "slower than timeout" not in log
        assert "Traceback" in log and "trainer.fit" in log  # stopped in set-up, never in a step


# -- before any process: the settings ------------------------------------------------------


def test_auto_with_a_schedule_the_memory_model_lacks_is_refused_naming_the_ones_it_knows() -> None:
    with pytest.raises(
        PipeckptConfigError,
        match=r"checkpoint='auto' with schedule='interleaved_1f1b'.*\['gpipe', '1f1b'\].*HINT: set schedule",
    ):
        PipelineStrategy(
            engine="distributed",
            checkpoint="auto",
            memory_budget="1GiB",
            stages=4,
            virtual_stages=2,
            schedule="interleaved_1f1b",
        )


def test_auto_without_a_stage_count_is_refused_before_any_process() -> None:
    with pytest.raises(PipeckptConfigError, match=r"neither stages nor balance.*HINT: set stages"):
        PipelineStrategy(engine="distributed", checkpoint="auto", memory_budget="1GiB")


def test_auto_under_1f1b_never_offers_fewer_micro_batches_than_ranks() -> None:
    torch.manual_seed(0)
    model = MLP(in_features=8, hidden=16, depth=2, num_classes=4)
    settings = PipeSettings(
        engine="distributed",
        stages=2,
        chunks=4,
        schedule="1f1b",
        checkpoint="auto",
        memory_budget="1GiB",
        memory_search=["modes", "chunks"],
    )
    auto = resolve_auto(settings, model.layers, devices=[torch.device("cpu")], batch=torch.randn(8, 8))
    assert sorted(auto.profiles) == [2, 4, 8]  # 1 micro-batch cannot fill 1F1B's two stages
    assert auto.choice.chunks in (2, 4, 8)


def test_the_engine_refuses_a_chosen_plan_of_another_stage_count_than_its_topology() -> None:
    topology = Topology(pp=2, dp=1, virtual_stages=1, kind=lookup("gpipe"))
    chosen = PipeSettings(engine="distributed", balance=[1, 1, 1], checkpoint=["never"] * 3)
    with pytest.raises(PipeckptConfigError, match="a plan of 3 stages on a pipeline of 2"):
        adopt(chosen, topology)


def test_the_engine_refuses_a_chosen_chunk_count_its_schedule_cannot_run() -> None:
    topology = Topology(pp=2, dp=1, virtual_stages=1, kind=lookup("1f1b"))
    chosen = PipeSettings(engine="distributed", balance=[2, 2], chunks=1, checkpoint=["never", "always"])
    with pytest.raises(PipeckptConfigError, match=r"chunks=1 with schedule='1f1b' on pp=2"):
        adopt(chosen, topology)


def test_the_engine_adopts_chosen_settings_resolved() -> None:
    topology = Topology(pp=2, dp=1, virtual_stages=1, kind=lookup("gpipe"))
    chosen = PipeSettings(engine="distributed", balance=[2, 2], chunks=4, checkpoint=["always", "never"])
    adopted = adopt(DistributedEngine.resolve(chosen), topology)
    assert (adopted.schedule, adopted.timeout, adopted.virtual_stages) == ("gpipe", 60.0, 1)
    assert adopted.checkpoint == ["always", "never"] and adopted.balance == [2, 2]


def _smallest_budget(settings: PipeSettings, layout: Optional[Layout], module: Any, batch: Any) -> int:
    """The smallest feasible budget auto names when refusing one of a byte."""
    tiny = replace(settings, memory_budget=1)
    optimizer = fitted_optimizer(module)
    with pytest.raises(PipeckptConfigError) as refused:
        resolve_auto(
            tiny,
            module.layers,
            devices=[torch.device("cpu")],
            batch=batch,
            optimizer=optimizer,
            layout=layout,
        )
    found = re.search(r"the smallest feasible budget is .* \((\d+) bytes\)", str(refused.value))
    assert found is not None, refused.value
    return int(found[1])


def test_the_fsdp_launchs_auto_budget_fits_one_ranks_sharded_stage_and_not_a_whole_one() -> None:
    name, model, _, strategy, _ = fsdp_auto_run
    module, data = fsdp_build(model)
    x, _ = replica_rows(data, 0, strategy["dp"])[0]  # what rank 0 profiles: its replica's first batch
    settings = PipeSettings(engine="distributed", **strategy)
    engine = DistributedEngine(settings)
    engine.configure_world(World(num_nodes=1, num_processes=4))
    sharded = _smallest_budget(settings, Layout(**engine.memory_layout()), module, x)
    whole = _smallest_budget(replace(settings, data_parallel="ddp"), None, module, x)
    assert sharded < strategy["memory_budget"] < whole, (name, sharded, whole)


def test_the_plan_command_under_the_distributed_engine_prints_the_per_rank_plan_auto_chooses(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(WORKER.parents[1]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    overrides = [
        "model=mlp",
        "ckpt=auto",
        "memory.budget=2MiB",
        "memory.search=[modes,chunks]",
        "strategy.engine=distributed",
        "strategy.schedule=1f1b",
        f"memory.png={tmp_path / 'plan.png'}",
    ]
    result = forkserver.run(
        [sys.executable, "-m", "pipeckpt.plan", *overrides],
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    chosen = re.search(r"checkpoint=(\[.*?\]), chunks=(\d+).*\(1f1b schedule\)", result.stdout)
    assert chosen is not None, result.stdout
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "layers", "mode"])
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert lines[0].startswith("schedule 1f1b (Schedule1F1B") and f"chunks {chosen[2]};" in lines[0]
    assert [row[0] for row in rows] == ["0", "1"]  # one row per stage, i.e. per rank
    assert str([row[2] for row in rows]).replace('"', "'") == chosen[1]
    assert all(row[-1] == "fits" for row in rows)
    assert int(chosen[2]) >= 2  # 1F1B on two ranks runs no fewer micro-batches
