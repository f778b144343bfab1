"""Layout settings named beside ``strategy.layout=auto`` on the command line are kept, the rest searched
(``pipeckpt/layout/pins.py``): the plan command's table and train.py's pick hold them; a pin no layout can
keep is refused naming it and why, before any layout is fitted. On a published preset, in-process."""

import os
from pathlib import Path
from typing import Any

import pytest
from support.layout_configs import LLAMA, compose_train

from pipeckpt import PipeckptConfigError
from pipeckpt.plan import run
from pipeckpt.plan_layout import Answer
from pipeckpt.plan_pick import PICK_VARIABLE, apply_layout, given_layout

AUTO = ["model=gpt", "strategy.engine=distributed", "trainer.devices=4", "strategy.layout=auto"]
H100 = ["cluster=h100_8", "data.batch_size=16"]


def _ranked(tmp_path: Path, *pins: str) -> Any:
    answer, _, _ = run([*AUTO, *H100, f"memory.png={tmp_path / 'frontier.png'}", *pins])
    assert isinstance(answer, Answer)
    return answer.searched.ranked


def test_every_layout_ranked_keeps_the_schedule_and_chunks_named(tmp_path: Path) -> None:
    ranked = _ranked(tmp_path, "strategy.schedule=Interleaved1F1B", "strategy.chunks=4")
    assert ranked and all(r.candidate.schedule == "interleaved_1f1b" for r in ranked)
    assert all(r.candidate.chunks == 4 for r in ranked)
    assert {r.candidate.pp for r in ranked} == {2}  # the search still chooses the rest: pp2 for v2 x 4 stages


def test_without_pins_the_same_search_ranks_other_schedules_too(tmp_path: Path) -> None:
    assert len({r.candidate.schedule for r in _ranked(tmp_path)}) > 1  # so the test above can fail


def test_a_pinned_balance_cuts_every_layout_so_and_no_twin_is_cut_by_time(tmp_path: Path) -> None:
    ranked = _ranked(tmp_path, "strategy.balance=[4,3]")
    assert ranked and all(r.candidate.balance == (4, 3) and r.candidate.stages == 2 for r in ranked)
    assert ranked[0].candidate.describe().startswith("pp2 by hand x")  # not its cut by time


def test_a_pinned_degree_the_model_cannot_take_is_refused_saying_why() -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"strategy.tensor_parallel=2: the model is not split by tensor"
    ):
        run([*AUTO, *H100, "strategy.tensor_parallel=2"])


def test_pins_no_layout_keeps_together_are_refused_naming_them() -> None:
    with pytest.raises(
        PipeckptConfigError, match=r"strategy.chunks=3: no layout the engine runs on 4 devices"
    ):
        run([*AUTO, *H100, "strategy.chunks=3"])  # 3 micro-batches divide no replica's batch of 16


def test_a_pin_with_a_bad_value_is_refused_by_the_settings_own_check() -> None:
    cfg = compose_train([*AUTO, *H100, "strategy.chunks=0"])
    with pytest.raises(PipeckptConfigError, match=r"chunks=0: the number of micro-batches must be"):
        given_layout(cfg, ["strategy.chunks=0"])


def test_a_value_from_a_config_file_is_not_a_pin() -> None:
    cfg = compose_train([*AUTO, *H100])
    assert not given_layout(cfg, AUTO)  # conf/strategy/pipe.yaml's chunks and schedule are defaults


def test_train_pys_pick_keeps_the_pinned_degrees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PICK_VARIABLE, "")
    monkeypatch.delenv(PICK_VARIABLE)  # restored (unset) after the test: apply_layout sets it
    pins = ["strategy.stages=4", "strategy.dp=1"]
    overrides = ["model=hf", LLAMA % (64, 4, 2, 512), "model.seq_len=32", *AUTO[1:], *H100, *pins]
    picked = apply_layout(compose_train(overrides), say=lambda *a, **k: None, overrides=overrides)
    assert (picked.strategy.stages, picked.strategy.dp, picked.strategy.layout) == (4, 1, "manual")
    assert picked.data.batch_size == 16 and os.environ[PICK_VARIABLE]


def test_a_pinned_data_parallel_is_what_every_ranked_layout_trains_with(tmp_path: Path) -> None:
    ranked = _ranked(tmp_path, "strategy.data_parallel=fsdp")
    assert ranked and all(r.candidate.settings()["data_parallel"] == "fsdp" for r in ranked)
