"""A layout given by hand (``strategy.layout=manual``) with a cluster named: the plan command checks
and predicts it as the search does each of its layouts, its own modes kept, on a published preset
(its figures in conf/cluster/, no calibration)."""

from pathlib import Path

import pytest

from pipeckpt import PipeckptConfigError
from pipeckpt.plan import main, run
from pipeckpt.plan_layout import Answer

HAND = [
    "model=gpt",
    "strategy.engine=distributed",
    "trainer.devices=4",
    "strategy.stages=2",
    "strategy.dp=2",
    "strategy.data_parallel=fsdp",
    "strategy.schedule=1f1b",
    "strategy.chunks=4",
    "data.batch_size=8",
]


def _searched(png: Path, *extra: str) -> Answer:
    auto = ["model=gpt", "strategy.engine=distributed", "trainer.devices=4", "strategy.layout=auto"]
    answer, _, _ = run([*auto, "data.batch_size=16", f"memory.png={png}", *extra])  # 8 a replica
    assert isinstance(answer, Answer)
    return answer


def test_a_layout_given_by_hand_is_predicted_as_the_search_predicts_it(tmp_path: Path) -> None:
    answer, _, _ = run([*HAND, "ckpt=always", "cluster=h100_8"])
    assert isinstance(answer, Answer) and answer.searched.considered == 1
    (mine,) = answer.searched.ranked
    c = mine.candidate
    assert (c.pp, c.tp, c.dp_replicate, c.dp_shard, c.schedule, c.chunks) == (2, 1, 1, 2, "1f1b", 4)
    assert c.modes == ("always", "always")  # its own, not chosen
    # the same layout among the search's (global batch 2 x 8), with the modes the search chose
    ranked = _searched(tmp_path / "frontier.png", "cluster=h100_8").searched.ranked
    searched = {(r.candidate.describe(), r.candidate.schedule, r.candidate.chunks): r for r in ranked}
    twin = searched[(c.describe(), "1f1b", 4)]
    assert twin.candidate.modes == ("never", "never")  # the search needs no recompute here
    assert mine.estimate.step_s > twin.estimate.step_s  # recompute costs time
    assert mine.fitted.peak < twin.fitted.peak  # and buys memory


def test_a_layout_by_hand_that_does_not_fit_says_its_peak(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*HAND, "cluster=h100_8", "cluster.device.memory_bytes=1000"]) == 0
    out = capsys.readouterr().out
    assert "0 fit" in out and "dropped: pp2 x tp1 x dp2 (fsdp 2) 1f1b:" in out


def test_a_layout_by_hand_on_a_cluster_of_other_size_is_refused_naming_both() -> None:
    with pytest.raises(PipeckptConfigError, match=r"pp2 x tp1 x dp2 \(4 devices\) on a cluster of 8"):
        run([*HAND, "cluster=h100_8", "trainer.devices=8"])


def test_a_cluster_named_under_the_local_engine_is_refused_naming_the_engine() -> None:
    with pytest.raises(PipeckptConfigError, match=r"cluster= with strategy.engine=local"):
        run(["model=mlp", "cluster=h100_8"])


def test_a_layout_by_hand_has_train_pys_strategy_checks_before_any_work() -> None:
    with pytest.raises(PipeckptConfigError, match=r"chunks=0: the number of micro-batches"):
        run([*HAND, "ckpt=always", "cluster=h100_8", "strategy.chunks=0"])


def test_a_misspelt_strategy_key_on_a_layout_by_hand_is_refused_naming_the_key() -> None:
    with pytest.raises(PipeckptConfigError, match=r"strategy\(schedul=\.\.\.\).*did you mean schedule"):
        run([*HAND, "ckpt=always", "cluster=h100_8", "+strategy.schedul=1f1b"])


def test_a_layout_by_hand_under_auto_without_a_budget_is_fitted_to_the_device() -> None:
    answer, _, _ = run([*HAND, "ckpt=auto", "cluster=h100_8"])  # train.py would ask for a budget
    assert isinstance(answer, Answer) and len(answer.searched.ranked) == 1
    assert answer.searched.ranked[0].candidate.modes  # the fit chose one mode per stage
