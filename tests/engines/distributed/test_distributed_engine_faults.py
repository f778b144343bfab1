"""The distributed engine (`engine="distributed"`) when a rank fails mid-step: one that dies, hangs
or raises makes the others exit non-zero within the collectives' `timeout`, naming the lost rank and
its pipeline stage (quoting a raised error with its traceback), or saying that every other rank is
alive when one hangs.

Slow tests start two real processes with gloo on CPU (tests/engines/distributed/distributed_worker.py)
and stop both, whatever happens.
"""

import re
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import support.ranks as ranks
from support.distributed_runs import START_S, STEPS, WORKER


def _start(world: int, runs: List[Dict[str, Any]], out: Path) -> List[ranks.Rank]:
    return ranks.start(WORKER, world, runs, out)


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
