"""A SIGTERM while the strategy sets the model up (pipeckpt/state/termination.py, ``stop_on_sigterm``):
no step boundary to wait for and nothing to save, so the process stops at once with one line naming
what it was doing and exit 143, passes the signal on to the ranks it launched and waits for them; a
SIGTERM handler of the user's own is left alone. The 2-process run of it is
tests/faults/test_sigterm_loading.py."""

import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest

from pipeckpt.state import termination

LINE = (
    "pipeckpt: rank 3 stopped by SIGTERM while loading the model, before the first step: nothing was "
    "trained or saved; exiting with 143\n"
)


@pytest.fixture(autouse=True)
def sigterm_as_it_was() -> Iterator[None]:
    """SIGTERM's default action in the test (a plugin of the runner may have set one), and the
    handler it found afterwards."""
    handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, handler)
    termination._stopping.clear()  # this process goes on


def _signalled(**kwargs) -> SystemExit:
    with pytest.raises(SystemExit) as stopped:
        with termination.stop_on_sigterm(3, "loading the model", **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises here, at once
    return stopped.value


def test_a_sigterm_inside_stops_with_143_and_one_line_naming_what_it_was_doing(capsys):
    started = time.monotonic()
    stopped = _signalled()
    assert (stopped.code, capsys.readouterr().out) == (143, LINE)
    assert time.monotonic() - started < 10
    assert termination.stopping()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler it found, back


def test_the_ranks_it_launched_are_sent_the_sigterm_and_waited_for():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        _signalled(children=[child])
        assert child.returncode == 143  # waited for: it ended before this process went on
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_sigterm_handler_of_the_users_own_is_left_alone():
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    with termination.stop_on_sigterm(0, "loading the model"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    assert seen == [signal.SIGTERM] and not termination.stopping()
