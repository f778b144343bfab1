"""``strategy.layout=auto`` from the command line: the plan command ranks layouts, train.py trains with
the pick (under torchrun too, where every process runs train.py: rank 0's pick), and a bad value is
refused naming the setting.

The plan runs in-process on a published preset (its figures are in conf/cluster/, no calibration);
the acceptance command on ``cluster=local`` and the 4-process training run are slow tests.
"""

import json
import os
import re
import sys
from pathlib import Path
from typing import List, Optional

import pytest
from support import forkserver
from support.layout_configs import compose_train, train_py
from support.paths import launcher_free
from support.ranks import free_port

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt.layout.report import format_row
from pipeckpt.plan import main, run
from pipeckpt.plan_layout import Answer
from pipeckpt.plan_pick import PICK_VARIABLE, apply_layout, given_modes

ROOT = Path(__file__).resolve().parents[2]
AUTO = ["model=gpt", "strategy.engine=distributed", "trainer.devices=4", "strategy.layout=auto"]


def test_the_plan_command_ranks_layouts_fastest_first(tmp_path: Path) -> None:
    answer, _, _ = run([*AUTO, "cluster=h100_8", f"memory.png={tmp_path / 'frontier.png'}"])
    assert isinstance(answer, Answer)
    ranked = answer.searched.ranked
    assert len(ranked) >= 3
    times = [r.estimate.step_s for r in ranked]
    assert times == sorted(times)
    assert all(r.candidate.world == 4 for r in ranked)
    assert all(r.fitted.peak <= answer.cluster.device.memory_bytes for r in ranked)


def test_the_plan_command_prints_the_table_the_runner_up_line_and_the_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "frontier.png"
    assert main([*AUTO, "cluster=h100_8", f"memory.png={png}"]) == 0
    out = capsys.readouterr().out
    assert "layout search:" in out and "tok/s/dev" in out
    assert "runner-up " in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("top", [[], ["memory.top=5"]])  # every layout fitted; or priced first, as train.py
def test_a_mode_named_on_the_command_line_is_kept_on_every_stage_of_every_layout(
    tmp_path: Path, top: List[str]
) -> None:
    answer, _, _ = run([*AUTO, "cluster=h100_8", "ckpt=always", f"memory.png={tmp_path / 'f.png'}", *top])
    assert isinstance(answer, Answer)
    assert len(answer.searched.ranked) >= 3
    for r in answer.searched.ranked:
        assert set(r.candidate.modes) == {"always"} and len(r.candidate.modes) == r.candidate.stages, r


@pytest.mark.parametrize(
    "overrides, kept",
    [
        ([], None),  # train.yaml's default is not the user's choice: searched
        (["ckpt=always"], "always"),
        (["strategy.checkpoint=selective"], "selective"),
        (["ckpt=auto"], None),
    ],
)
def test_only_a_mode_the_command_line_names_is_kept(overrides: List[str], kept: Optional[str]) -> None:
    cfg = compose_train([*AUTO, "cluster=h100_8", *overrides])
    assert given_modes(cfg, [*AUTO, *overrides]) == kept


def test_a_mode_per_stage_with_layout_auto_is_refused_naming_the_modes() -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"checkpoint modes \['always', 'never'\] \(2 modes\) with strategy"
    ):
        run([*AUTO, "cluster=h100_8", "ckpt.modes=[always,never]"])


def test_the_pick_given_by_hand_as_printed_is_checked_to_the_same_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(PICK_VARIABLE, "")  # restored (unset) after the test: apply_layout sets it
    monkeypatch.delenv(PICK_VARIABLE)
    apply_layout(compose_train([*AUTO, "cluster=h100_8"]))
    said = capsys.readouterr().out.splitlines()
    picked = next(line for line in said if line.startswith("strategy.layout=auto: training with "))
    hand = next(line for line in said if line.startswith("the pick by hand, without a search: "))
    manual = [o for o in AUTO if o != "strategy.layout=auto"]
    answer, _, _ = run([*manual, "cluster=h100_8", *hand.split(": ", 1)[1].split()])
    (checked,) = answer.searched.ranked
    assert picked == f"strategy.layout=auto: training with {format_row(1, checked).strip()}"


def test_a_pick_this_process_handed_on_earlier_is_not_taken_again(monkeypatch: pytest.MonkeyPatch) -> None:
    stale = {"settings": {"stages": 2, "dp": 1, "chunks": 4}, "dp": 1, "row": "stale", "by": os.getpid()}
    monkeypatch.setenv(PICK_VARIABLE, json.dumps(stale))  # as an earlier run of a sweep leaves it here
    picked = apply_layout(compose_train([*AUTO, "cluster=h100_8"]), say=lambda *a, **k: None)
    assert json.loads(os.environ[PICK_VARIABLE])["row"] != "stale"  # searched anew, and handed on
    assert (picked.strategy.stages, picked.strategy.chunks) != (2, 4)


def test_a_misspelt_layout_is_refused_naming_the_setting() -> None:
    with pytest.raises(PipeckptConfigError, match=r"^layout='autoo': is one of \['manual', 'auto'\]"):
        run(["strategy.layout=autoo"])


def test_layout_auto_under_the_local_engine_is_refused_naming_the_engine() -> None:
    with pytest.raises(PipeckptConfigError, match=r"strategy.layout=auto with strategy.engine=local"):
        run(["model=gpt", "strategy.layout=auto", "cluster=h100_8"])


def test_layout_auto_on_a_model_without_a_sequence_length_is_refused_naming_the_model() -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"strategy.layout=auto with model._target_=pipeckpt.app.models.MLP"
    ):
        run(
            [
                "model=mlp",
                "strategy.engine=distributed",
                "trainer.devices=2",
                "strategy.layout=auto",
                "cluster=h100_8",
            ]
        )


def test_the_strategy_built_with_layout_auto_without_a_cluster_names_the_presets() -> None:
    with pytest.raises(PipeckptConfigError, match=r"^layout='auto' with cluster=None: .*cluster='local'"):
        PipelineStrategy(engine="distributed", layout="auto")


@pytest.mark.slow
def test_the_acceptance_command_on_the_local_cluster_ranks_at_least_three_layouts(tmp_path: Path) -> None:
    answer, _, _ = run([*AUTO, "cluster=local", f"memory.png={tmp_path / 'frontier.png'}"])
    assert isinstance(answer, Answer)
    assert len(answer.searched.ranked) >= 3


@pytest.mark.slow
def test_train_py_trains_with_the_layout_the_search_picks(tmp_path: Path) -> None:
    done = train_py([*AUTO, "cluster=local"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    first = next(line for line in lines if line.startswith(" 1 pp"))  # the table's first row
    assert f"strategy.layout=auto: training with {first.strip()}" in lines
    assert done.stdout.count("layout search:") == 1  # the processes Lightning starts take the pick
    assert "2 steps in" in done.stdout


@pytest.mark.slow
def test_train_py_under_torchrun_trains_rank_0s_pick_on_every_rank(tmp_path: Path) -> None:
    env = launcher_free({k: v for k, v in os.environ.items() if k != PICK_VARIABLE})
    env.update(PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
    ]
    command = [
        *torchrun,
        "train.py",
        "model=gpt",
        "strategy.engine=distributed",
        "trainer.devices=2",
        "strategy.layout=auto",
        "cluster=local",  # measured here: two searches could pick apart
        "trainer.max_steps=2",
        "trainer.accelerator=cpu",
        "validate=false",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp_path}",
    ]
    done = forkserver.run(command, cwd=ROOT, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("layout search:") == 1, out  # rank 0's, alone
    row = next(line for line in out.splitlines() if line.startswith(" 1 pp")).strip()
    assert f"strategy.layout=auto: training with {row} (rank 0's search)" in out, out
    assert "2 steps in" in out


@pytest.mark.parametrize(
    "given, named",
    [
        (["ckpt=auto", "memory.budget=1GiB"], "memory.budget=1GiB"),
        (["memory.search=[modes]"], "memory.search="),
    ],
)
def test_a_budget_beside_layout_auto_is_refused_as_the_search_fits_each_device(
    given: List[str], named: str
) -> None:
    """Until 2026-12-06 the search fitted every layout to the cluster's devices and dropped the
    budget without a word."""
    with pytest.raises(
        PipeckptConfigError, match=rf"^{re.escape(named)}.* with strategy.layout=auto: .*memory_bytes"
    ):
        run(
            [
                "model=gpt",
                "strategy.engine=distributed",
                "trainer.devices=2",
                "strategy.layout=auto",
                "cluster=h100_8",
                *given,
            ]
        )


LAB = """name: lab
nodes: 1
devices_per_node: 4
device:
  name: L40S
  memory_bytes: 51539607552
  peak_flops: {bf16-mixed: 362e12, 32-true: 91.6e12}
  memory_bytes_per_s: 864e9
  efficiency: 0.5
intra_node_bytes_per_s: 32e9
inter_node_bytes_per_s: 12.5e9
latency_s: 2e-5
"""


def test_a_cluster_described_in_a_folder_of_the_users_own_is_searched_on(tmp_path: Path) -> None:
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "lab.yaml").write_text(LAB)
    png = f"memory.png={tmp_path / 'frontier.png'}"
    answer, _, _ = run([*AUTO, "cluster=lab", f"hydra.searchpath=[file://{tmp_path}]", png])
    assert isinstance(answer, Answer)
    assert (answer.cluster.device.name, answer.cluster.device.memory_bytes) == ("L40S", 48 * 2**30)
    assert len(answer.searched.ranked) >= 3
