"""Out of space, named (issue 37, item 3), under the distributed engine: the disk fills up for rank 1
of a two-process run, so its shard of the step-4 checkpoint cannot be written. Every rank exits
non-zero saying "no space left on device" with the path and the rank whose write failed, none
speaks of a timeout or a lost rank, and the previous checkpoint resumes. The local engine's are in
test_full_disk.py."""

from pathlib import Path

import pytest
import support.ranks as ranks

from pipeckpt.state import sharded

WORKER = Path(__file__).resolve().parent / "run_files_worker.py"
START_S = 240  # process start and set-up on a loaded 2-core machine


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """The run whose disk fills up for rank 1 after step 3 (checkpoints every 2 steps)."""
    out = tmp_path_factory.mktemp("full")
    run = dict(name="full", dir=str(out / "checkpoints"), steps=8, every=2, full=dict(rank=1, after=3))
    codes = ranks.exit_codes(WORKER, 2, [run], out, within_s=START_S)
    assert codes == [1, 1], ranks.logs(out, 2)
    return out


@pytest.mark.slow
def test_every_rank_says_no_space_with_the_path_and_the_rank_whose_write_failed(full):
    path = str(full / "checkpoints" / "epoch=0-step=4.ckpt")
    for rank in range(2):
        log = (full / f"rank{rank}.log").read_text()
        expected = f"PipeckptSaveError: checkpoint {path!r}: no space left on device (rank 1 writing "
        assert expected in log, ranks.logs(full, 2)
        assert "HINT: free space on that filesystem" in log
        assert "timeout" not in log and "lost rank" not in log, ranks.logs(full, 2)


@pytest.mark.slow
def test_after_a_full_disk_the_previous_checkpoint_resumes(full, tmp_path):
    last = full / "checkpoints" / "last.ckpt"
    assert sharded.load(last)["global_step"] == 2
    run = dict(name="resumed", dir=str(tmp_path / "checkpoints"), steps=4, every=2, resume=str(last))
    ranks.launch(WORKER, 2, [run], tmp_path, within_s=START_S)
    assert sharded.load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 4
