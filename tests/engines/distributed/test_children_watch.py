"""The launching process's watch of the ranks it started (pipeckpt/engines/distributed/children.py):
a rank stopped by SIGTERM (exit 143) passes SIGTERM on to the launching process, which then stops
as on a SIGTERM of its own, rather than being SIGKILLed (137, which reads as out of memory) as by
Lightning's watch; any other failure ends every process with SIGKILL, as Lightning's does. Real
processes stand in for the ranks and for the launching process (which says which signal it got)."""

import signal
import subprocess
import sys
from typing import Iterator, List

import pytest

from pipeckpt.engines.distributed.children import Watch

# A launching process: says "ready" once its SIGTERM handler is in place, "TERM" when it gets one.
MAIN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (print('TERM', flush=True), sys.exit(3)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def started() -> Iterator[List["subprocess.Popen[str]"]]:
    """Processes a test starts, each ended and reaped when it ends."""
    procs: List[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _start(started: List["subprocess.Popen[str]"], code: str) -> "subprocess.Popen[str]":
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    started.append(proc)
    return proc


def _main(started: List["subprocess.Popen[str]"]) -> "subprocess.Popen[str]":
    main = _start(started, MAIN)
    assert main.stdout is not None and main.stdout.readline() == "ready\n"
    return main


def test_a_rank_stopped_by_sigterm_passes_sigterm_to_the_launching_process(started):
    main = _main(started)
    rank = _start(started, "import sys; sys.exit(143)")
    Watch([rank], main_pid=main.pid, period=0.05, grace_s=0.5, main_stopping=lambda: False).run()
    assert main.wait(timeout=30) == 3 and main.stdout.read() == "TERM\n"  # its own answer, in time


def test_a_failed_rank_ends_the_launching_process_and_the_other_ranks_with_sigkill(started):
    main = _main(started)
    failed = _start(started, "import sys; sys.exit(1)")
    other = _start(started, "import time; time.sleep(60)")
    Watch([failed, other], main_pid=main.pid, period=0.05, main_stopping=lambda: False).run()
    assert (main.wait(timeout=30), other.wait(timeout=30)) == (-signal.SIGKILL, -signal.SIGKILL)
    assert main.stdout.read() == ""


def test_a_launching_process_that_is_stopping_is_given_its_grace_not_a_sigterm(started):
    main = _main(started)
    rank = _start(started, "import sys; sys.exit(143)")
    Watch([rank], main_pid=main.pid, period=0.05, grace_s=0.5, main_stopping=lambda: True).run()
    assert main.wait(timeout=30) == -signal.SIGKILL and main.stdout.read() == ""


def test_ranks_that_all_exit_0_leave_the_launching_process_alone(started):
    main = _main(started)
    ranks = [_start(started, "pass") for _ in range(2)]
    Watch(ranks, main_pid=main.pid, period=0.05).run()
    assert main.poll() is None
