"""A looped layout's modes (pipeckpt/layout/fit.py, ``Memory.fit``): each stage is chosen as a stage
of a 1F1B pipeline in an equal share of the device; where that finds none, the same mode on every
stage, its stages walked together along the rank's own order, is fitted where it fits the device
(the first of ``WALKED``, each recomputing more than the one before). Two linear layers of 64
features a stage, 4 stages on 2 ranks, 2 micro-batches: here every uniform mode's walked peak is
known, and a device at one of them makes the per-stage choice find nothing."""

from dataclasses import replace

import pytest
from test_search import linears, shapes_of

from pipeckpt import PipeckptConfigError
from pipeckpt.layout.candidates import Candidate
from pipeckpt.layout.fit import Memory

LOOPED = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")


def _memory(device_bytes: int) -> Memory:
    return Memory(shapes_of(linears(), []), device_bytes=device_bytes, global_batch=8)


def _walked(c: Candidate, mode: str) -> tuple:
    return _memory(2**30).fit(replace(c, modes=(mode,))).peaks


@pytest.mark.parametrize("schedule", LOOPED)
def test_where_no_stage_fits_half_the_device_the_walked_uniform_mode_that_fits_is_fitted(schedule):
    c = Candidate(2, 1, 1, 1, schedule, 2, 2)
    never = _walked(c, "never")
    memory = _memory(max(never))
    with pytest.raises(PipeckptConfigError, match="no plan fits"):
        memory._fit(c)  # each stage as a 1F1B stage in half the device: nothing
    fitted = memory.fit(c)
    assert fitted.candidate.modes == ("never",) * 4
    assert fitted.peaks == never


@pytest.mark.parametrize("schedule", LOOPED)
def test_where_neither_the_stages_nor_a_uniform_mode_fit_the_layout_is_refused(schedule):
    c = Candidate(2, 1, 1, 1, schedule, 2, 2)
    least = min(max(_walked(c, m)) for m in ("never", "except_last", "always"))
    with pytest.raises(PipeckptConfigError, match="no plan fits"):
        _memory(least // 2).fit(c)  # the per-stage choice can mix modes: below any of them too
