"""A pipelined layout cut by time in a search of a model with a heavy head (an HF Llama whose 4,096-token
head is 2.5 of its layers' FLOPs): listed beside its cut by parameters, its cut printed by hand,
checked by hand to the same row, and trained with it."""

from pathlib import Path
from typing import Any, List

import pytest
from support.layout_configs import LLAMA, llama_search, train_py

from pipeckpt import PipeckptConfigError, plan_layout
from pipeckpt.layout.report import format_row
from pipeckpt.plan import run

MODEL = ["model=hf", LLAMA % (64, 4, 2, 4096), "model.seq_len=32", "strategy.engine=distributed"]


def _timed_row() -> Any:
    answer = plan_layout.search_config(llama_search("cluster=h100_8", "data.batch_size=16", vocab=4096))
    return next(r for r in answer.searched.ranked if r.candidate.balance)


def _by_hand(row: Any) -> List[str]:
    cfg = llama_search("cluster=h100_8", "data.batch_size=16", vocab=4096)
    return plan_layout.by_hand(cfg, row.candidate.settings())


def test_a_layout_cut_by_time_is_checked_by_hand_to_the_same_row() -> None:
    row = _timed_row()
    assert row.candidate.describe().startswith("pp2 by time") and row.candidate.balance == (3, 1)
    hand = _by_hand(row)
    assert "strategy.balance=[3,1]" in hand
    answer, _, _ = run([*MODEL, "trainer.devices=2", "cluster=h100_8", *hand])
    (checked,) = answer.searched.ranked
    assert format_row(1, checked) == format_row(1, row)


def test_a_balance_by_hand_that_does_not_add_up_to_the_layers_is_refused_naming_it() -> None:
    hand = ["strategy.stages=2", "strategy.dp=1", "strategy.balance=[3,2]", "data.batch_size=4"]
    with pytest.raises(
        PipeckptConfigError, match=r"balance \[3, 2\] \(sum 5\).*sum to the number of layers.*\(4\)"
    ):
        run([*MODEL, "trainer.devices=2", "cluster=h100_8", *hand])


@pytest.mark.slow
def test_train_py_trains_a_layout_cut_by_time(tmp_path: Path) -> None:
    hand = ["strategy.stages=2", "strategy.dp=1", "strategy.schedule=1f1b", "strategy.chunks=2"]
    cut = ["strategy.balance=[3,1]", "data.batch_size=4", "data.max_bytes=200000"]
    done = train_py([*MODEL, "trainer.devices=2", *hand, *cut], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 steps in" in done.stdout
