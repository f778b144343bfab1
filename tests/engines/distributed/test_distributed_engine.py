"""The distributed engine (`engine="distributed"`): one process per pipeline rank.

Slow tests start real processes with gloo on CPU (tests/engines/distributed/distributed_worker.py, one
thread each),
several trainings per start, and compare the parameters with the local engine's on the same stages
and micro-batches (no dropout). Fast tests check the errors raised before any step.
"""

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import lightning as L
import pytest
import support.ranks as ranks
import torch
from support.toy import ToyModule, assert_bitwise_equal, fit, max_relative_difference, params, toy_loader
from support.trainers import QUIET

from pipeckpt import PipeckptConfigError, PipeckptWarning, PipelineStrategy
from pipeckpt.engines.distributed import DistributedEngine
from pipeckpt.engines.distributed.logs import LogRecorder
from pipeckpt.engines.distributed.step import PipelinedStep
from pipeckpt.state import sharded

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_worker.py"
START_S = 240  # a group of trainings, processes started on a loaded 2-core machine


def distributed(**kwargs: Any) -> PipelineStrategy:
    return PipelineStrategy(engine="distributed", **kwargs)


def trainer(strategy: PipelineStrategy, devices: int) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False)


# -- errors before any step ------------------------------------------------------------


def test_engine_distributed_drives_the_strategy_with_the_distributed_engine():
    strategy = distributed(balance=[3, 3])
    assert isinstance(strategy.engine, DistributedEngine)
    t = trainer(strategy, devices=2)
    assert t.strategy.is_distributed
    assert (t.strategy.engine.topology.pp, t.strategy.engine.topology.dp) == (2, 1)


def test_replicas_get_their_own_batches_and_stages_of_one_replica_the_same():
    t = trainer(distributed(balance=[3, 3], dp=2), devices=4)
    assert (t.strategy.engine.topology.pp, t.strategy.engine.topology.dp) == (2, 2)
    assert t.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_dp_that_does_not_divide_the_world_is_rejected():
    with pytest.raises(
        PipeckptConfigError, match=r"dp=3 with a world of 4.*pp x dp must equal the world size.*HINT"
    ):
        trainer(distributed(dp=3), devices=4)


@pytest.mark.parametrize(
    "settings, devices, rule",
    [
        (dict(stages=3, virtual_stages=2, schedule="interleaved_1f1b"), 2, "stages must divide evenly"),
        (
            dict(stages=4, dp=1, virtual_stages=2, schedule="interleaved_1f1b"),
            4,
            r"stages = pp x virtual_stages",
        ),
        (dict(stages=3), 2, "pp x dp must equal the world size"),
    ],
    ids=["virtual", "too-few-stages", "world"],
)
def test_stages_that_do_not_divide_into_the_processes_are_rejected(settings, devices, rule):
    with pytest.raises(PipeckptConfigError, match=rf"(?s){rule}.*HINT"):
        trainer(distributed(**settings), devices=devices)


def test_virtual_stages_need_the_interleaved_schedule():
    with pytest.raises(PipeckptConfigError, match=r"virtual_stages=2 with schedule='1f1b'.*HINT"):
        distributed(virtual_stages=2, schedule="1f1b")


def test_1f1b_with_fewer_microbatches_than_stages_is_rejected():
    with pytest.raises(
        PipeckptConfigError,
        match=r"chunks=2 with schedule='1f1b' on pp=4.*at least as many "
        r"micro-batches as pipeline stages.*HINT",
    ):
        trainer(distributed(chunks=2, schedule="1f1b"), devices=4)


def test_a_batch_chunks_does_not_divide_runs_with_fewer_microbatches_or_fails_clearly():
    engine = trainer(distributed(chunks=4, schedule="1f1b"), devices=2).strategy.engine
    step = PipelinedStep(None, None, [], engine.processes, chunks=4, device=torch.device("cpu"))
    with pytest.warns(PipeckptWarning, match=r"batch of 10 samples.*runs as 2 micro-batches.*HINT"):
        assert step.counts.of(10, train=True) == 2
    assert step.counts.of(3, train=True) == 3
    with pytest.raises(
        PipeckptConfigError,
        match=r"batch of 1 samples.*equal micro-batches.*at least as many "
        r"micro-batches as pipeline stages.*HINT: .*drop_last",
    ):
        step.counts.of(1, train=True)
    assert step.counts.of(1, train=False) == 1  # forward only: any count


def _slurm(monkeypatch: pytest.MonkeyPatch, name: str, per_node: int) -> None:
    for key, value in dict(
        SLURM_JOB_NAME=name,
        SLURM_NTASKS=str(per_node),
        SLURM_NTASKS_PER_NODE=str(per_node),
        SLURM_NNODES="1",
        SLURM_NODELIST="n1",
        SLURM_JOB_ID="7",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
    ).items():
        monkeypatch.setenv(key, value)


def test_devices_must_match_ntasks_per_node_under_slurm(monkeypatch):
    _slurm(monkeypatch, "train", per_node=4)
    with pytest.raises(
        PipeckptConfigError,
        match=r"devices=2 with SLURM --ntasks-per-node=4.*HINT: set the "
        r"trainer's devices=4",
    ):
        trainer(distributed(), devices=2)


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_a_slurm_job_named_like_a_shell_warns_that_slurm_is_ignored(monkeypatch, name):
    _slurm(monkeypatch, name, per_node=2)
    with pytest.warns(PipeckptWarning, match=rf"(?s)SLURM.*'{name}'.*ignores SLURM.*HINT"):
        trainer(distributed(), devices=2)


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


# -- real processes ------------------------------------------------------------------------


def _start(world: int, runs: List[Dict[str, Any]], out: Path) -> List[ranks.Rank]:
    return ranks.start(WORKER, world, runs, out)


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Iterator[Any]:
    def run(world: int, runs: List[Dict[str, Any]]) -> Path:
        return ranks.launch(WORKER, world, runs, tmp_path_factory.mktemp(f"world{world}"), within_s=START_S)

    yield run


def _state(path: Path) -> Dict[str, Any]:
    """A checkpoint as one dict: the distributed engine writes a sharded directory, which
    the converter turns into the single file the local engine writes."""
    if sharded.is_sharded(path):
        single = path.parent / f"{path.name}.pt"
        sharded.to_torch_save(path, single)
        path = single
    return torch.load(path, map_location="cpu", weights_only=False)


def _local(**kwargs: Any) -> PipelineStrategy:
    return PipelineStrategy(**kwargs)


TWO = [  # name, distributed settings, the local engine's equivalent, depth
    (
        "gpipe",
        dict(balance=[3, 3], chunks=4, schedule="gpipe", checkpoint="except_last"),
        dict(balance=[3, 3], chunks=4, checkpoint="except_last"),
        6,
    ),
    (
        "1f1b_mix",
        dict(balance=[3, 3], chunks=4, schedule="1f1b", checkpoint=["always", "except_last"]),
        dict(balance=[3, 3], chunks=4, checkpoint=["always", "except_last"]),
        6,
    ),
    (
        "interleaved_mix",
        dict(
            balance=[2, 1, 1, 2],
            chunks=4,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            checkpoint=["never", "always", "except_last", "offload"],
        ),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint=["never", "always", "except_last", "offload"]),
        6,
    ),
    (
        "looped_bfs_mix",
        dict(
            balance=[2, 1, 1, 2],
            chunks=4,
            schedule="looped_bfs",
            virtual_stages=2,
            checkpoint=["always", "never", "offload", "except_last"],
        ),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint=["always", "never", "offload", "except_last"]),
        6,
    ),
    # Zero-bubble schedules split backward into input and weight passes: checkpoint "never" only.
    (
        "interleaved_zero_bubble",
        dict(
            balance=[2, 1, 1, 2],
            chunks=4,
            schedule="InterleavedZeroBubble",
            virtual_stages=2,
            checkpoint="never",
        ),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint="never"),
        6,
    ),
    (
        "zbv_zero_bubble",
        dict(
            balance=[2, 1, 1, 2], chunks=4, schedule="zbv_zero_bubble", virtual_stages=2, checkpoint="never"
        ),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint="never"),
        6,
    ),
    (
        "dual_pipe_v",
        dict(balance=[2, 1, 1, 2], chunks=4, schedule="DualPipeV", virtual_stages=2, checkpoint="never"),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint="never"),
        6,
    ),
]
FOUR = [
    (
        "pp4_1f1b_mix",
        dict(
            balance=[2, 2, 1, 1],
            chunks=4,
            schedule="1f1b",
            checkpoint=["always", "never", "except_last", "always"],
        ),
        dict(balance=[2, 2, 1, 1], chunks=4, checkpoint=["always", "never", "except_last", "always"]),
        6,
    ),
    (
        "pp4_interleaved",
        dict(
            balance=[1] * 8, chunks=4, schedule="interleaved_1f1b", virtual_stages=2, checkpoint="except_last"
        ),
        dict(balance=[1] * 8, chunks=4, checkpoint="except_last"),
        8,
    ),
    # Looped schedules on two replicas: a zero-bubble one's averaged after the step (under DDP,
    # whose reducer its split backward never ran, each replica trained on its half alone), kept
    # and recomputed; an interleaved one's under DDP.
    *(
        (
            f"dp2_{schedule}_{mode}",
            dict(balance=[2, 1, 1, 2], chunks=4, schedule=schedule, virtual_stages=2, dp=2, checkpoint=mode),
            dict(balance=[2, 1, 1, 2], chunks=4, checkpoint=mode),
            6,
        )
        for schedule, mode in [
            ("zbv_zero_bubble", "never"),
            ("zbv_zero_bubble", "always"),
            ("interleaved_zero_bubble", "except_last"),
            ("interleaved_1f1b", "never"),
        ]
    ),
    # Two replicas of a 2-stage pipeline, each on half of every batch, against one pipeline on all of it.
    ("dp2_pp2", dict(balance=[3, 3], chunks=4, schedule="1f1b", dp=2), dict(balance=[3, 3], chunks=4), 6),
]
STEPS = 4
# a zero-bubble schedule on two replicas (averaged after the step), over batches accumulated and clipped
ZBV_ON_REPLICAS = dict(
    name="dp2_zbv_accumulate_clip",
    strategy=dict(balance=[2, 1, 1, 2], chunks=4, schedule="zbv_zero_bubble", virtual_stages=2, dp=2),
    depth=6,
)
# Every schedule that can recompute, with dropout on: a mode mix must not change one bit.
DROPOUT = {
    "gpipe": dict(balance=[3, 3], chunks=4, schedule="gpipe"),
    "1f1b": dict(balance=[3, 3], chunks=4, schedule="1f1b"),
    "interleaved_1f1b": dict(balance=[2, 1, 1, 2], chunks=4, schedule="interleaved_1f1b", virtual_stages=2),
    "looped_bfs": dict(balance=[2, 1, 1, 2], chunks=4, schedule="looped_bfs", virtual_stages=2),
}
MIX = {2: ["always", "except_last"], 4: ["offload", "always", "except_last", "never"]}


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


@pytest.fixture(scope="module")
def four_processes(launch) -> Path:
    runs = [dict(name=n, strategy=d, depth=depth, steps=STEPS) for n, d, _, depth in FOUR]
    # the replicas' layout fitted again in the same processes: its mesh's groups are not made twice
    runs.append(dict(runs[-1], name="dp2_pp2_again", steps=1))
    runs.append(dict(ZBV_ON_REPLICAS, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05))
    return launch(4, runs)


@pytest.mark.slow
def test_a_pipeline_that_is_the_whole_world_talks_in_the_default_group_on_a_mesh_of_pp_alone(two_processes):
    # No dp dimension of one process each: that would open a process group per process that
    # nothing uses (an idle gloo group beside the pipeline's costs every step, bench_host_cost.py).
    for rank in range(2):
        seen = json.loads((two_processes / f"gpipe.rank{rank}.json").read_text())
        assert (seen["mesh"], seen["pipeline_in_default_group"]) == (["pp"], True)


@pytest.mark.slow
def test_replicas_of_a_pipeline_keep_a_mesh_with_a_data_parallel_dimension(four_processes):
    for rank in range(4):
        seen = json.loads((four_processes / f"dp2_pp2.rank{rank}.json").read_text())
        assert (seen["mesh"], seen["pipeline_in_default_group"]) == (["dp", "pp"], False)


@pytest.mark.slow
def test_a_process_that_fits_the_same_layout_again_opens_no_new_process_group(four_processes):
    # torch frees a mesh's groups only with the default group: made at every fit, a process
    # fitting one Trainer after another would gather a set per fit (engines/distributed/kept_groups)
    for rank in range(4):
        first = json.loads((four_processes / f"dp2_pp2.rank{rank}.json").read_text())
        again = json.loads((four_processes / f"dp2_pp2_again.rank{rank}.json").read_text())
        assert first["gloo_groups"] >= 3  # the default group, and this rank's dp and pp groups
        assert again["gloo_groups"] == first["gloo_groups"]


@pytest.mark.slow
@pytest.mark.parametrize("name, settings, local, depth", TWO, ids=[t[0] for t in TWO])
def test_two_processes_train_like_the_local_engine(two_processes, name, settings, local, depth):
    reference = fit(ToyModule(depth=depth), _local(**local), steps=STEPS)
    got = _state(two_processes / f"{name}.ckpt")
    assert max_relative_difference(got["state_dict"], params(reference.lightning_module)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name, settings, local, depth", FOUR, ids=[t[0] for t in FOUR])
def test_four_processes_train_like_the_local_engine(four_processes, name, settings, local, depth):
    reference = fit(ToyModule(depth=depth), _local(**local), steps=STEPS)
    got = _state(four_processes / f"{name}.ckpt")
    assert max_relative_difference(got["state_dict"], params(reference.lightning_module)) < 1e-5


@pytest.mark.slow
def test_accumulation_and_clipping_span_replicas_that_average_after_the_step(four_processes):
    reference = fit(
        ToyModule(depth=6),
        _local(balance=[2, 1, 1, 2], chunks=4),
        steps=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
    )
    got = _state(four_processes / f"{ZBV_ON_REPLICAS['name']}.ckpt")
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


def _run_until_rank0_exits(runs: Any, tmp_path: Any) -> Any:
    """Starts 2 ranks, waits for rank 0 to exit (or START_S), always stops both;
    returns the processes, when rank 0 ended (None: it did not) and both logs."""
    procs = _start(2, runs, tmp_path)
    try:
        procs[0].wait(timeout=START_S)
        ended = time.time()
    except subprocess.TimeoutExpired:
        ended = None
    finally:
        ranks.stop(procs)
    return procs, ended, ranks.logs(tmp_path, 2)


@pytest.mark.slow
def test_a_rank_that_dies_mid_step_is_named_and_the_others_exit(tmp_path):
    runs = [
        dict(
            name="fault",
            strategy=dict(balance=[3, 3], chunks=4, schedule="1f1b", timeout=20),
            steps=STEPS,
            die=dict(step=2, microbatch=2),
        )
    ]
    procs, ended, output = _run_until_rank0_exits(runs, tmp_path)
    died = re.search(r"worker: rank 1 dies at time=([\d.]+)", output)
    assert died, output
    assert ended is not None and ended - float(died.group(1)) < 20, output  # within `timeout`
    assert procs[0].returncode != 0, output
    survivor = (tmp_path / "rank0.log").read_text()
    assert re.search(r"lost rank 1 \(pipeline stage 1 of data-parallel replica 0\)", survivor), output


@pytest.mark.slow
def test_a_rank_that_hangs_makes_the_others_fail_after_the_timeout(tmp_path):
    runs = [
        dict(
            name="hang",
            strategy=dict(balance=[3, 3], chunks=4, schedule="1f1b", timeout=5),
            steps=STEPS,
            die=dict(step=2, microbatch=2, hang=True),
        )
    ]
    procs, ended, output = _run_until_rank0_exits(runs, tmp_path)
    hung = re.search(r"worker: rank 1 hangs at time=([\d.]+)", output)
    # The collective runs out of timeout=5; the diagnosis after it takes no fixed wait.
    assert hung and ended is not None and ended - float(hung.group(1)) < 3 * 5, output
    assert procs[0].returncode != 0, output
    assert "every other rank is alive" in (tmp_path / "rank0.log").read_text(), output


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
def test_a_rank_that_raises_is_quoted_by_the_others_with_its_error_and_traceback(tmp_path):
    runs = [
        dict(
            name="raise",
            strategy=dict(balance=[3, 3], chunks=4, schedule="1f1b", timeout=20),
            steps=STEPS,
            die=dict(step=2, microbatch=2, raises=True),
        )
    ]
    procs, ended, output = _run_until_rank0_exits(runs, tmp_path)
    raised = re.search(r"worker: rank 1 raises at time=([\d.]+)", (tmp_path / "rank1.log").read_text())
    assert raised and ended is not None and ended - float(raised.group(1)) < 20, output
    assert procs[0].returncode != 0, output
    survivor = (tmp_path / "rank0.log").read_text()
    assert re.search(
        r"rank 1 \(pipeline stage 1 of data-parallel replica 0\) raised ValueError: "
        r"the last layer refuses micro-batch 2 of step 2",
        survivor,
    ), output
    assert "traceback:" in survivor and "distributed_worker.py" in survivor, output
    assert "ValueError: the last layer refuses" in (tmp_path / "rank1.log").read_text(), output


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
