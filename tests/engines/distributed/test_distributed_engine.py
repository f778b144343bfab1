"""The distributed engine (`engine="distributed"`, one process per pipeline rank) on two ranks trains
like the local engine: the same parameters under every schedule and checkpoint mode mix (with
accumulation and clipping too), one checkpoint of the whole model under the local keys, each rank
writing only its own stages' tensors, resumable under either engine; the same recomputes, dropout
bitwise unchanged by recompute, rank 0 seeing what the last stage logged (reduced over micro-batches
as Lightning would), and a per-stage report measured where each stage ran. Every schedule torch
installs is proven by these runs or the four-rank ones (test_distributed_engine_replicas.py), or refused.

Slow tests start real processes with gloo on CPU (tests/engines/distributed/distributed_worker.py, one
thread each), several trainings per start (one start per file: :func:`support.distributed_runs.launch`),
and compare the parameters with the local engine's on the same stages and micro-batches (no dropout).
"""

import json
from pathlib import Path
from typing import Dict, List

import lightning as L
import pytest
import torch

# launch is the module's fixture. START_S, WORKER, _state and launch are imported from here by
# test_distributed_dropout_bn.py, tests/state/test_resume_matrix.py and tests/checkpointing/test_mode_order.py
from support.distributed_runs import DROPOUT, FOUR, MIX, STEPS, TWO
from support.distributed_runs import START_S as START_S
from support.distributed_runs import WORKER as WORKER
from support.distributed_runs import checkpoint_state as _state
from support.distributed_runs import launch as launch
from support.distributed_runs import local_strategy as _local
from support.toy import ToyModule, assert_bitwise_equal, fit, max_relative_difference, params, toy_loader
from support.trainers import QUIET

from pipeckpt import PipeckptConfigError
from pipeckpt.engines.distributed.logs import LogRecorder


@pytest.fixture(scope="module")
def local_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("local") / "local.ckpt"
    fit(ToyModule(), _local(balance=[3, 3], chunks=4), steps=STEPS).save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def two_processes(launch, local_checkpoint) -> Path:
    runs = [dict(name=n, strategy=d, depth=depth, steps=STEPS) for n, d, _, depth in TWO]
    runs[0]["validate"] = True
    runs[1]["report"] = True  # 1f1b_mix: a per-stage report from every rank's stages
    runs.append(
        dict(
            name="accumulate_clip",
            strategy=dict(balance=[3, 3], chunks=4, schedule="1f1b"),
            steps=2,
            accumulate_grad_batches=2,
            gradient_clip_val=0.05,
        )
    )
    runs.append(
        dict(
            name="from_local",
            strategy=dict(balance=[3, 3], chunks=4, schedule="1f1b"),
            steps=2 * STEPS,
            resume=str(local_checkpoint),
        )
    )
    for name, settings in DROPOUT.items():  # the same run with and without recompute, dropout on
        for modes in ("never", MIX[len(settings["balance"])]):
            tag = "never" if modes == "never" else "mix"
            runs.append(
                dict(
                    name=f"{name}_dropout_{tag}",
                    strategy=dict(settings, checkpoint=modes),
                    dropout=0.3,
                    steps=3,
                )
            )
    runs.append(
        dict(
            name="from_distributed",
            strategy=dict(balance=[3, 3], chunks=4, schedule="1f1b"),
            steps=2 * STEPS,
            resume_run="gpipe",
        )
    )
    return launch(2, runs)


@pytest.mark.slow
def test_a_pipeline_that_is_the_whole_world_talks_in_the_default_group_on_a_mesh_of_pp_alone(two_processes):
    # No dp dimension of one process each: that would open a process group per process that
    # nothing uses (an idle gloo group beside the pipeline's costs every step, bench_host_cost.py).
    for rank in range(2):
        seen = json.loads((two_processes / f"gpipe.rank{rank}.json").read_text())
        assert (seen["mesh"], seen["pipeline_in_default_group"]) == (["pp"], True)


@pytest.mark.slow
@pytest.mark.parametrize("name, settings, local, depth", TWO, ids=[t[0] for t in TWO])
def test_two_processes_train_like_the_local_engine(two_processes, name, settings, local, depth):
    reference = fit(ToyModule(depth=depth), _local(**local), steps=STEPS)
    got = _state(two_processes / f"{name}.ckpt")
    assert max_relative_difference(got["state_dict"], params(reference.lightning_module)) < 1e-5


@pytest.mark.slow
def test_accumulation_and_clipping_by_norm_span_the_pipeline(two_processes):
    reference = fit(
        ToyModule(),
        _local(balance=[3, 3], chunks=4),
        steps=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
    )
    got = _state(two_processes / "accumulate_clip.ckpt")
    assert max_relative_difference(got["state_dict"], params(reference.lightning_module)) < 1e-5


@pytest.mark.slow
def test_checkpoint_holds_the_whole_model_and_optimizer_under_the_local_keys(two_processes, local_checkpoint):
    got, local = _state(two_processes / "1f1b_mix.ckpt"), _state(local_checkpoint)
    assert sorted(got["state_dict"]) == sorted(local["state_dict"])
    ToyModule().load_state_dict(got["state_dict"], strict=True)  # the unpipelined module's keys
    mine, theirs = got["optimizer_states"][0], local["optimizer_states"][0]
    assert mine["param_groups"] == theirs["param_groups"]
    assert sorted(mine["state"]) == sorted(theirs["state"])
    for i, state in theirs["state"].items():
        for key, value in state.items():
            assert torch.allclose(mine["state"][i][key], value, rtol=1e-5, atol=1e-7), (i, key)


def _resume_locally(ckpt: Path) -> Dict[str, torch.Tensor]:
    module = ToyModule(seed=99)  # the checkpoint must overwrite everything
    torch.manual_seed(123)
    t = L.Trainer(
        strategy=_local(balance=[3, 3], chunks=4),
        devices=1,
        max_steps=2 * STEPS,
        **QUIET,
    )
    t.fit(module, toy_loader(), ckpt_path=ckpt)
    return params(module)


@pytest.mark.slow
def test_a_local_checkpoint_resumes_under_the_distributed_engine(two_processes, local_checkpoint):
    got = _state(two_processes / "from_local.ckpt")["state_dict"]
    assert max_relative_difference(got, _resume_locally(local_checkpoint)) < 1e-5


@pytest.mark.slow
def test_a_distributed_checkpoint_resumes_under_the_local_engine(two_processes):
    by_distributed = _state(two_processes / "from_distributed.ckpt")["state_dict"]
    assert max_relative_difference(_resume_locally(two_processes / "gpipe.ckpt"), by_distributed) < 1e-5


@pytest.mark.slow
def test_checkpoint_modes_count_the_same_recomputes_under_1f1b(two_processes):
    calls = {}
    for rank in range(2):
        calls.update(json.loads((two_processes / f"1f1b_mix.rank{rank}.json").read_text())["forward_calls"])
    # 4 steps of 4 micro-batches: `always` recomputes all 4; `except_last` on 1F1B's last stage,
    # where every backward follows its own forward at once, recomputes none (pipeckpt.checkpointing.order).
    assert calls == {"0": STEPS * (4 + 4), "1": STEPS * (4 + 0)}


def test_logged_values_are_reduced_over_microbatches_like_lightning_would():
    recorder = LogRecorder("training_step")
    for v in (1.0, 2.0, 3.0, 6.0):
        recorder.log("loss", torch.tensor(v), prog_bar=True)
        recorder.log("seen", v, reduce_fx="sum", batch_size=2)
        recorder.log("worst", torch.tensor(v), reduce_fx=torch.max)
    reduced = {name: (value.item(), options) for name, value, options in recorder.reduced()}
    assert reduced["loss"][0] == 3.0 and reduced["loss"][1]["prog_bar"]
    assert reduced["seen"][0] == 12.0 and reduced["seen"][1]["batch_size"] == 8
    assert reduced["worst"][0] == 6.0 and reduced["worst"][1]["reduce_fx"] == "max"
    with pytest.raises(PipeckptConfigError, match="HINT"):
        recorder.log("bad", object())


@pytest.mark.slow
def test_rank_zero_sees_what_the_last_stage_logged(two_processes):
    reference = fit(
        ToyModule(),
        _local(balance=[3, 3], chunks=4, checkpoint="except_last"),
        steps=STEPS,
        limit_val_batches=1.0,
    )
    expected = {"train_loss": float(reference.callback_metrics["train_loss"])}
    reference.validate(reference.lightning_module, toy_loader(), verbose=False)
    expected["val_loss"] = float(reference.callback_metrics["val_loss"])
    seen = json.loads((two_processes / "gpipe.rank0.json").read_text())["metrics"]
    assert seen == pytest.approx(expected, rel=1e-5)


def _stage_of_key(key: str, balance: List[int]) -> int:
    """The stage index of a state-dict key ``layers.<i>...`` under ``balance``."""
    layer = int(key.split(".")[1])
    bounds = [sum(balance[: j + 1]) for j in range(len(balance))]
    return next(j for j, bound in enumerate(bounds) if layer < bound)


@pytest.mark.slow
def test_each_rank_writes_only_its_own_stages_tensors(two_processes):
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(two_processes / "gpipe.ckpt")).read_metadata()
    files: Dict[int, set] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("state_dict."):
            stage = _stage_of_key(index.fqn[len("state_dict.") :], [3, 3])
            files.setdefault(stage, set()).add(info.relative_path)
    # balance [3, 3] on two ranks: stage j is rank j's, written into rank j's file only.
    assert {j: sorted(f) for j, f in files.items()} == {0: ["__0_0.distcp"], 1: ["__1_0.distcp"]}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(DROPOUT))
def test_recompute_under_every_schedule_leaves_dropout_training_bitwise_unchanged(two_processes, schedule):
    never = _state(two_processes / f"{schedule}_dropout_never.ckpt")["state_dict"]
    mix = _state(two_processes / f"{schedule}_dropout_mix.ckpt")["state_dict"]
    assert_bitwise_equal(mix, never)
    plain = ToyModule(dropout=0.3).state_dict()
    assert max_relative_difference(never, plain) > 1e-3  # it trained


def test_every_installed_schedule_is_proven_or_refused():
    from pipeckpt.engines.distributed.schedules import installed, lookup

    proven = {t[1]["schedule"].replace("_", "").lower() for t in TWO + FOUR} | {
        s["schedule"].replace("_", "").lower() for s in DROPOUT.values()
    }
    for name in installed():
        kind = lookup(name)  # refused schedules raise here, naming why
        assert name.lower() in proven, f"{name} has no equivalence test"
        assert kind.cls.__name__ == f"Schedule{name}"


@pytest.mark.slow
def test_the_stage_report_holds_every_stages_figures_from_the_rank_that_runs_it(two_processes):
    rows = json.loads((two_processes / "1f1b_mix" / "stage_report.json").read_text())
    assert [r["stage"] for r in rows] == [0, 1]
    assert [r["mode"] for r in rows] == ["always", "except_last"]
    for row in rows:  # measured where the stage ran: no stage is left at zero
        assert row["forward_s"] > 0 and row["backward_s"] > 0 and row["peak_activation_bytes"] > 0, row
    # 4 micro-batches under 1F1B: 'always' recomputes all 4; 'except_last' on the last stage, where
    # each backward follows its own forward at once, keeps every micro-batch (pipeckpt.checkpointing.order).
    assert [r["recomputed"] for r in rows] == [4, 0]
