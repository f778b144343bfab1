"""The tests' fork server (tests/support/forkserver.py) starts ranks that behave as fresh processes
would: the script as ``__main__`` with its own arguments, environment, directory, session and log,
Lightning's rank from the environment, and the exit status the script ended with."""

import json
import os
import signal
from pathlib import Path

import pytest
from support import forkserver
from support.paths import worker_pythonpath

SCRIPT = """
import json, os, sys
from lightning_utilities.core.rank_zero import rank_zero_only
print(json.dumps({
    "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "marker": os.environ.get("MARKER"),
    "session_leader": os.getsid(0) == os.getpid(), "path0": sys.path[0], "rank": rank_zero_only.rank,
    "hash": hash("pipeckpt"),
}))
code = os.environ.get("EXIT")
if code == "raise":
    raise ValueError("the worker's own error")
if code == "kill":
    os.kill(os.getpid(), 9)
if code == "text":
    sys.exit("a message")
if code is not None:
    sys.exit(int(code))
"""


def fork(tmp_path: Path, rank: int = 0, **env: str) -> forkserver.Forked:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "SLURM_"))}
    base.update(PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", LOCAL_RANK=str(rank), **env)
    base["PYTHONPATH"] = worker_pythonpath()
    return forkserver.start(script, ["an-arg"], base, rank, tmp_path, tmp_path / f"rank{rank}.log")


def seen(tmp_path: Path, rank: int = 0) -> dict:
    return json.loads((tmp_path / f"rank{rank}.log").read_text().splitlines()[0])


def test_a_forked_rank_runs_the_script_as_main_with_its_arguments_environment_and_directory(tmp_path):
    proc = fork(tmp_path, MARKER="given")
    assert proc.wait(timeout=60) == 0
    got = seen(tmp_path)
    assert got["name"] == "__main__"
    assert got["argv"] == [str(tmp_path / "worker.py"), "an-arg"]
    assert (got["cwd"], got["path0"], got["marker"]) == (str(tmp_path), str(tmp_path), "given")
    assert got["session_leader"] is True  # killpg(pid) ends the rank and all it started


def test_lightnings_rank_is_the_environments_not_the_servers(tmp_path):
    assert fork(tmp_path, rank=3).wait(timeout=60) == 0
    assert seen(tmp_path, 3)["rank"] == 3


def test_neighbouring_ranks_hash_strings_differently_as_separate_interpreters_do(tmp_path):
    for rank in (0, 1):
        assert fork(tmp_path, rank=rank).wait(timeout=60) == 0
    assert seen(tmp_path, 0)["hash"] != seen(tmp_path, 1)["hash"]


@pytest.mark.parametrize(("exit_", "code"), [("0", 0), ("3", 3), ("raise", 1), ("text", 1), ("kill", -9)])
def test_the_exit_status_is_the_scripts(tmp_path, exit_, code):
    assert fork(tmp_path, EXIT=exit_).wait(timeout=60) == code


def test_an_uncaught_error_reaches_the_ranks_log(tmp_path):
    fork(tmp_path, EXIT="raise").wait(timeout=60)
    assert "ValueError: the worker's own error" in (tmp_path / "rank0.log").read_text()


def test_a_started_rank_can_be_signalled_at_once_times_out_as_popen_does_and_reports_its_signal(tmp_path):
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=worker_pythonpath())
    proc = forkserver.start(tmp_path / "sleeper.py", [], env, 0, tmp_path, tmp_path / "sleeper.log")
    os.killpg(proc.pid, 0)  # its session and log exist once start returns, as with Popen
    assert (tmp_path / "sleeper.log").exists()
    with pytest.raises(forkserver.subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
