"""Sequence parallelism in a layout search: each layout with tp > 1 profiled with its residual stream
split along the sequence too (pipeckpt/memory/sequence_local.py), the rest as without it. On a
described cluster the search runs it wherever the model takes it, unless the user says
``strategy.sequence_parallel=false``; the pick trains with it only where it splits layers."""

import functools
from typing import Any, Dict, Tuple

import pytest
from support.layout_configs import llama_search
from support.local_cluster import FIGURES

from pipeckpt import plan_layout, plan_pick
from pipeckpt.layout import calibrate
from pipeckpt.layout.cluster import cluster

Peaks = Dict[Any, Tuple[int, ...]]


@functools.cache
def _searched(*extra: str) -> Any:
    """The search of the small Llama on 8 H100 (a global batch of 16), once per ``extra``."""
    return plan_layout.search_config(llama_search("cluster=h100_8", "data.batch_size=16", *extra))


def _peaks(*extra: str) -> Peaks:
    """Each ranked layout's peaks, by its layout less the sequence switch (a search with and one
    without it name the same layouts)."""
    from dataclasses import replace

    ranked = _searched(*extra).searched.ranked
    return {replace(r.candidate, sequence=False, modes=()): r.fitted.peaks for r in ranked}


def test_sequence_parallelism_lowers_every_tensor_parallel_layouts_peak_and_no_other():
    alone, sequence = _peaks("strategy.sequence_parallel=false"), _peaks("strategy.sequence_parallel=true")
    split = [c for c in alone if c.tp > 1]
    assert split and set(sequence) >= set(alone)
    for c in alone:
        if c.tp > 1:
            assert max(sequence[c]) < max(alone[c]), c
        else:
            assert sequence[c] == alone[c], c


def test_on_a_described_cluster_every_split_layout_runs_sequence_parallelism_unless_the_user_says_not():
    unset, off = _searched().searched.ranked, _searched("strategy.sequence_parallel=false").searched.ranked
    assert any(r.candidate.tp > 1 for r in unset)
    assert all(r.candidate.sequence == (r.candidate.tp > 1) for r in unset)
    assert not any(r.candidate.sequence for r in off)


def test_the_search_on_its_own_peaks_equals_the_search_with_sequence_parallelism_given():
    assert _peaks() == _peaks("strategy.sequence_parallel=true")


def test_a_split_pick_trains_and_reads_by_hand_with_sequence_parallelism(monkeypatch):
    cfg = llama_search("cluster=h100_8", "data.batch_size=16")
    answer = plan_layout.search_config(cfg, only=[_split_pick()])
    settings = answer.searched.best.candidate.settings()
    assert settings["tensor_parallel"] == 2 and settings["sequence_parallel"] is True
    assert "strategy.sequence_parallel=true" in plan_layout.by_hand(cfg, settings)
    monkeypatch.delenv(plan_pick.PICK_VARIABLE, raising=False)
    picked = plan_pick.apply_layout(cfg, say=lambda *a, **k: None, pick={"settings": settings, "dp": 4})
    monkeypatch.delenv(plan_pick.PICK_VARIABLE)  # apply_layout hands the pick on through it
    assert picked.strategy.sequence_parallel is True and picked.strategy.tensor_parallel == 2


def _split_pick() -> Any:
    ranked = _searched().searched.ranked
    return next(r.candidate for r in ranked if r.candidate.tp == 2)


def test_a_pick_without_tensor_parallelism_trains_without_sequence_parallelism(monkeypatch):
    cfg = llama_search("cluster=h100_8", "data.batch_size=16", "strategy.sequence_parallel=true")
    monkeypatch.setenv(plan_pick.PICK_VARIABLE, "")  # unset again after the test: apply_layout sets it
    monkeypatch.delenv(plan_pick.PICK_VARIABLE)
    picked = plan_pick.apply_layout(cfg, say=lambda *a, **k: None)
    assert int(picked.strategy.get("tensor_parallel") or 1) == 1  # this small Llama's pick on 8 H100
    assert not picked.strategy.get("sequence_parallel")  # else the strategy would refuse it


def test_on_this_machine_sequence_parallelism_stays_the_users(monkeypatch: pytest.MonkeyPatch):
    """On ``cluster=local`` a split layer's time is measured with the plain split, so the search
    does not turn sequence parallelism on by itself."""
    monkeypatch.setattr(calibrate, "measured", lambda: dict(FIGURES))
    local = cluster("local", devices=2)
    for given, runs in ((None, False), (True, True)):
        extra = [] if given is None else [f"strategy.sequence_parallel={str(given).lower()}"]
        cfg = llama_search("cluster=h100_8", *extra)
        with plan_layout._searching(cfg) as (_, model, _, shapes):
            assert model.sequence_parallel  # on a described cluster: taken, or as given
            assert plan_layout.sequence_choice(cfg, local, shapes, model.tensor_parallel) is runs


def test_a_search_with_sequence_parallelism_on_a_model_built_as_one_ranks_share_is_refused(capsys):
    from pipeckpt.plan import main

    args = ["model=llama3", "strategy.engine=distributed", "trainer.devices=4", "data.batch_size=8"]
    assert main([*args, "strategy.layout=auto", "cluster=h100_8", "strategy.sequence_parallel=true"]) == 1
    assert "sequence_parallel=True on an nn.Sequential pipeline (Embed, ...)" in capsys.readouterr().err


def test_a_model_built_as_one_ranks_share_is_searched_without_it_when_not_asked():
    from support.layout_configs import compose_train

    args = ["model=llama3", "strategy.engine=distributed", "trainer.devices=4", "data.batch_size=8"]
    cfg = compose_train([*args, "strategy.layout=auto", "cluster=h100_8"])
    with plan_layout._searching(cfg) as (_, model, _, _):
        assert not model.sequence_parallel
