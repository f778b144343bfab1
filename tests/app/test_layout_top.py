"""``search_config(top=N)``: the N fastest layouts of a search of every layout, found without fitting
the layouts whose step floor (pipeckpt/layout/floor.py) is slower than them."""

from typing import Any, Dict, List, Tuple

import pytest
from support.layout_configs import llama_search
from support.local_cluster import FIGURES

from pipeckpt import plan_layout
from pipeckpt.layout import calibrate
from pipeckpt.layout.candidates import candidates
from pipeckpt.layout.fit import Memory
from pipeckpt.layout.search import search
from pipeckpt.plan import main


def _ranking(answer: Any) -> List[Tuple[Any, ...]]:
    return [(r.candidate, r.fitted.peaks, r.estimate.step_s) for r in answer.searched.ranked]


def test_the_top_layouts_are_those_of_the_search_of_every_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    fits: List[Any] = []
    fit = Memory.fit

    def counted(self: Memory, c: Any) -> Any:
        fits.append(c)
        return fit(self, c)

    monkeypatch.setattr(Memory, "fit", counted)
    cfg = llama_search("cluster=h100_8", "data.batch_size=16")
    every = plan_layout.search_config(cfg)
    every_fits, fits[:] = len(fits), []
    top = plan_layout.search_config(cfg, top=3)
    assert _ranking(top) == _ranking(every)[:3]
    assert top.searched.dropped_at("floor") > 0
    print(f"fitted {len(fits)} of the {every_fits} layouts a search of every layout fits")
    assert len(fits) < every_fits


@pytest.mark.usefixtures("one_thread")
def test_on_this_machine_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cluster=local``: costs from a profile timed here (once: two searches would time it twice,
    differently), and processes sharing the cores."""
    monkeypatch.setattr(calibrate, "measured", lambda: dict(FIGURES))
    cfg = llama_search("cluster=local", "threads=1", "data.batch_size=8")
    with plan_layout._searching(cfg) as (memory, model, where, shapes):
        price = plan_layout._cost(cfg, memory, where, shapes)
        found = candidates(where.world, model, global_batch=8, devices_per_node=where.devices_per_node)
        kw: Dict[str, Any] = dict(device_bytes=where.device.memory_bytes, state=memory.state_bytes)
        every = search(found, memory=memory.fit, cost=price.estimate, **kw)
        top = search(found, memory=memory.fit, cost=price.estimate, top=3, floor=price.floor, **kw)
    assert [(r.candidate, r.estimate.step_s) for r in top.ranked] == [
        (r.candidate, r.estimate.step_s) for r in every.ranked[:3]
    ]
    assert top.dropped_at("floor") > 0


def test_top_without_a_search_is_a_configuration_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model=mlp", "memory.top=3"]) == 1
    assert "memory.top=3: it ranks the fastest layouts of a search" in capsys.readouterr().err


def test_a_top_that_is_not_a_whole_number_is_a_configuration_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["model=mlp", "strategy.layout=auto", "memory.top=all"]) == 1
    assert "memory.top=all: a number of layouts is a whole number" in capsys.readouterr().err
