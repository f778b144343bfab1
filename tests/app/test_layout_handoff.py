"""``strategy.layout=auto`` under a launcher outside Lightning (torchrun, srun, a launch by hand), where
every process runs the script itself: global rank 0 searches and every rank trains its pick, rank 0's
failure reaches the others as its own error, and a missing rank 0 is named within the start-up window
(pipeckpt/engines/distributed/startup.py ``from_rank_zero``).

The ranks are real processes launched by hand (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``), each
applying the layout as train.py does; the search runs on a preset cluster (its figures in conf/cluster/).
To tell whose search a rank trains, rank 1 is given a precision its own search refuses.
"""

import json
import re
import time
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

import support.ranks as ranks

from pipeckpt.plan_pick import PICK_VARIABLE

HERE = Path(__file__).resolve().parent
WORKER = HERE / "layout_handoff_worker.py"
AUTO = [
    "model=gpt",
    "strategy.engine=distributed",
    "trainer.devices=2",
    "strategy.layout=auto",
    "cluster=h100_8",
]
REFUSED = "trainer.precision=64-true"  # refused by the search (no such FLOP/s on the preset), not before


def _run(
    overrides: Sequence[Sequence[str]], out: Path, started: Sequence[int], within_s: float
) -> Tuple[Any, str]:
    """Starts ``started`` of a world of 2 ranks, rank r on ``overrides[r]``; waits for them to exit (and
    always stops them); returns the processes and their logs."""
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "overrides": [list(o) for o in overrides]}))
    env = {k: v for k, v in ranks.rank_env(2).items() if k != PICK_VARIABLE}
    ended = ranks.run_some(WORKER, [str(spec)], env, started, out, within_s=within_s)
    return ended.procs, ended.logs


def _picked(out: Path, rank: int) -> Dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())


def test_rank_0_searches_and_every_rank_takes_its_pick(tmp_path: Path) -> None:
    procs, logs = _run([AUTO, [*AUTO, REFUSED]], tmp_path, started=[0, 1], within_s=240)
    assert [p.returncode for p in procs] == [0, 0], logs
    assert _picked(tmp_path, 1) == _picked(tmp_path, 0), logs
    zero, one = logs.split("--- rank 1 ---")
    assert "layout search:" in zero and "layout search:" not in one, logs  # one search, rank 0's
    row = re.search(r"strategy\.layout=auto: training with (.+)", zero).group(1).strip()
    assert f"strategy.layout=auto: training with {row} (rank 0's search)" in one, logs


def test_a_search_failing_on_rank_0_stops_the_other_rank_with_rank_0s_error(tmp_path: Path) -> None:
    begun = time.monotonic()
    procs, logs = _run([[*AUTO, REFUSED], AUTO], tmp_path, started=[0, 1], within_s=240)
    assert procs[0].returncode != 0 and procs[1].returncode != 0, logs
    assert time.monotonic() - begun < 200, logs  # told, not timed out (the window is 600 s)
    one = logs.split("--- rank 1 ---")[1]
    assert "rank 1 stops because the layout search (strategy.layout=auto) failed on rank 0" in one, logs
    assert "PipeckptConfigError: precision '64-true' on H100 SXM5 80GB" in one, logs


def test_a_rank_waiting_for_a_rank_0_that_never_starts_is_told_within_the_window(tmp_path: Path) -> None:
    window = 10
    begun = time.monotonic()
    procs, logs = _run(
        [AUTO, [*AUTO, f"strategy.start_timeout={window}"]], tmp_path, started=[1], within_s=window + 120
    )
    assert procs[0].returncode != 0 and time.monotonic() - begun < window + 100, logs
    assert f"rank 0 did not join the run within start_timeout={window}s, so rank 1 stops" in logs, logs
