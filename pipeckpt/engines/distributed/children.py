"""The other ranks of this node, started and watched by the launching process when no launcher
(torchrun, srun) did: Lightning's launcher, with a watch that tells a stop from a failure.

Why not Lightning's watch: its observer SIGKILLs every process, the launching one included, as soon
as any rank exits non-zero. A rank stopped by SIGTERM exits 143 (:mod:`pipeckpt.state.termination`),
so a SIGTERM that reached rank 1 alone ended the job 137, which reads as out of memory, and could
cut rank 0 short while it said why or saved. Here a rank that exited 143 (or was ended by SIGTERM)
passes SIGTERM on to the launching process and the other ranks, which stop as they stop on a
SIGTERM of their own (exit 143), unless the launching process is stopping already; a rank that
failed otherwise ends them all with SIGKILL, as Lightning's observer does (no rank is left waiting
in a collective). A process that a SIGTERM did not end within :data:`GRACE_S` is ended with SIGKILL.
"""

import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Optional, Sequence

from pipeckpt._compat import SubprocessScriptLauncher, split_threads_between, start_local_ranks
from pipeckpt.state.termination import EXIT_CODE, stopping

__all__ = ["GRACE_S", "ScriptLauncher", "Watch"]

log = logging.getLogger(__name__)

GRACE_S = 30.0
"""How long a process sent SIGTERM has to end before it is sent SIGKILL."""

_STOPPED = (EXIT_CODE, -signal.SIGTERM)  # exit 143, or ended by the signal itself


class Watch(threading.Thread):
    """Polls ``children`` every ``period`` seconds (Lightning's observer's period: a failing rank's
    neighbours have that long to say what they saw) until all have exited 0, or one has not."""

    def __init__(
        self,
        children: Sequence["subprocess.Popen[Any]"],
        *,
        main_pid: int,
        period: float = 5.0,
        grace_s: float = GRACE_S,
        main_stopping: Callable[[], bool] = stopping,
    ) -> None:
        super().__init__(daemon=True, name="pipeckpt-local-ranks")  # ends with the launching process
        self.children, self.main_pid = list(children), main_pid
        self.period, self.grace_s, self.main_stopping = period, grace_s, main_stopping

    def run(self) -> None:
        while True:
            time.sleep(self.period)
            codes = [child.poll() for child in self.children]
            if all(code == 0 for code in codes):
                return
            ended = next((i for i, code in enumerate(codes) if code), None)
            if ended is not None:
                self.answer(ended + 1, codes[ended])
                return

    def answer(self, rank: int, code: Optional[int]) -> None:
        """What local rank ``rank``'s exit with ``code`` asks of the others and of this process."""
        if code in _STOPPED:
            log.info(f"pipeckpt: local rank {rank} stopped by SIGTERM (exit {code}); stopping the others")
            self._signal(signal.SIGTERM, main=not self.main_stopping())
            time.sleep(self.grace_s)  # returns only if this process outlived it
        else:
            log.info(f"pipeckpt: local rank {rank} exited with {code}; ending the other ranks with SIGKILL")
        self._signal(signal.SIGKILL, main=True)

    def _signal(self, signum: int, *, main: bool) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)
        if main:
            os.kill(self.main_pid, signum)


class ScriptLauncher(SubprocessScriptLauncher):
    """Lightning's launcher of this node's other ranks, watched by :class:`Watch`."""

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            start_local_ranks(self)
            Watch(self.procs, main_pid=os.getpid()).start()
        split_threads_between(num_processes=self.num_processes)
        return function(*args, **kwargs)
