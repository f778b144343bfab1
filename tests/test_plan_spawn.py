"""A measurement's own gloo world (pipeckpt/plan_spawn.py): rank 0's figures come back; a process
that dies after every process had them handed back costs nothing but a warning; one that dies
before, or raises, fails the measurement with its own error."""

import pytest
from support import spawn_workers
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from pipeckpt.plan_spawn import spawned


def test_figures_handed_back_before_a_process_aborts_are_kept_with_a_warning_naming_the_signal() -> None:
    with pytest.warns(RuntimeWarning, match="SIGABRT after every process had its figures handed back"):
        assert spawned(spawn_workers.hands_back_then_aborts, (2,), 2) == {"rank": 0}


def test_a_process_that_aborts_before_the_figures_are_handed_back_fails_the_measurement() -> None:
    with pytest.raises(ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
        spawned(spawn_workers.aborts_before_handing_back, (2,), 2)


def test_a_process_that_raises_fails_the_measurement_with_its_own_error() -> None:
    with pytest.raises(ProcessRaisedException, match="rank 1's own error"):
        spawned(spawn_workers.raises, (2,), 2)
