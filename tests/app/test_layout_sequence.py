"""``strategy.sequence_parallel=true`` in a layout search: each layout with tp > 1 profiled with its
residual stream split along the sequence too (pipeckpt/memory/sequence_local.py), the rest as
without it; and the pick handed to training with sequence parallelism only where it splits layers."""

from typing import Any, Dict, Tuple

from support.layout_configs import llama_search

from pipeckpt import plan_layout, plan_pick


def _peaks(*extra: str) -> Dict[Any, Tuple[int, ...]]:
    cfg = llama_search("cluster=h100_8", "data.batch_size=16", *extra)
    answer = plan_layout.search_config(cfg)
    return {r.candidate: r.fitted.peaks for r in answer.searched.ranked}


def test_sequence_parallelism_lowers_every_tensor_parallel_layouts_peak_and_no_other():
    alone, sequence = _peaks(), _peaks("strategy.sequence_parallel=true")
    split = [c for c in alone if c.tp > 1]
    assert split and set(sequence) >= set(alone)
    for c in alone:
        if c.tp > 1:
            assert max(sequence[c]) < max(alone[c]), c
        else:
            assert sequence[c] == alone[c], c


def test_a_pick_without_tensor_parallelism_trains_without_sequence_parallelism(monkeypatch):
    cfg = llama_search("cluster=h100_8", "data.batch_size=16", "strategy.sequence_parallel=true")
    monkeypatch.setenv(plan_pick.PICK_VARIABLE, "")  # unset again after the test: apply_layout sets it
    monkeypatch.delenv(plan_pick.PICK_VARIABLE)
    picked = plan_pick.apply_layout(cfg, say=lambda *a, **k: None)
    assert int(picked.strategy.get("tensor_parallel") or 1) == 1  # this small Llama's pick on 8 H100
    assert picked.strategy.sequence_parallel is False  # else the strategy would refuse it


def test_a_search_with_sequence_parallelism_on_a_model_built_as_one_ranks_share_is_refused(capsys):
    from pipeckpt.plan import main

    args = ["model=llama3", "strategy.engine=distributed", "trainer.devices=4", "data.batch_size=8"]
    assert main([*args, "strategy.layout=auto", "cluster=h100_8", "strategy.sequence_parallel=true"]) == 1
    assert "sequence_parallel=True on an nn.Sequential pipeline (Embed, ...)" in capsys.readouterr().err
