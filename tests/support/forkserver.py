"""A fork server for the processes the tests start with Python (the ranks of the multi-process
tests, ``train.py`` and the project's commands): a Python process that has imported torch,
Lightning, transformers and pipeckpt once, and forks a process from that state on request.

Why: a fresh interpreter spends 10-13 s of CPU importing before it does any work (Lightning's
version checks import torchmetrics, which imports transformers and scipy), and the suite starts
about three hundred of them on a 2-core CI machine: the imports were the suite's largest cost. A
forked process is still a real process of its own (its own pid, session and process group,
sockets, environment, working directory, output files and exit status); it only skips the imports.

What a fork shares that a fresh interpreter would not: the state the imports left, and the start-up
settings read once by the interpreter and by torch. The server starts with none of the requests'
settings; each child applies its own request's ``PYTHONWARNINGS`` (plain actions) and
``OMP_NUM_THREADS``, and Lightning's rank. Two servers serve each pytest process, one for even
ranks and one for odd ones, each with its own string-hash seed, so that neighbouring ranks iterate
sets of strings in different orders, as ranks started by torchrun or SLURM do.
``PIPECKPT_TEST_FORK=0`` starts fresh interpreters instead.

The protocol is JSON lines over the server's stdin and stdout, nothing pickled: a request names the
command line after ``python``, the environment, working directory and output files; the server
forks, answers with the pid, reaps its children itself and writes each one's exit status to
``<pid>.rc`` in its status directory, which is where :class:`Forked` reads it.

Run as ``python forkserver.py STATUS_DIR`` by :func:`start` and :func:`run`; never by hand.
"""

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

# What every rank would import anyway; imported once per server.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "lightning.pytorch",
    "pipeckpt",
    "pipeckpt.strategy",
    "transformers",
)


class Forked:
    """A rank forked by a server, seen as much like :class:`subprocess.Popen` as the tests use it:
    ``pid``, ``poll``, ``wait`` (raising :class:`subprocess.TimeoutExpired`) and ``returncode``
    (negative: the signal that ended it), set only once the process is gone."""

    def __init__(self, pid: int, status: Path, args: List[str], server: "Server") -> None:
        self.pid, self.args, self.returncode = pid, args, None
        self._status, self._server = status, server

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if not self._server.alive():
                raise RuntimeError(f"the fork server died before pid {self.pid} ended: {self._server.log}")
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class Server:
    """One server process, started with ``env`` and ready once its imports are done."""

    def __init__(self, env: Dict[str, str], cwd: Path) -> None:
        self.status = Path(tempfile.mkdtemp(prefix="pipeckpt-forkserver-"))
        self.log = self.status / "server.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(self.status)],
                env=env,
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        if self._stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start:\n{self.log.read_text()[-3000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, argv: List[str], env: Dict[str, str], cwd: Path, stdout: Path, stderr: Path) -> Forked:
        """Forks ``python argv`` (a script and its arguments, or ``-m module ...``)."""
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        for path in (stdout, stderr):  # there from the answer on, as with Popen
            path.write_bytes(b"")
        self._stdin.write(json.dumps(request) + "\n")
        self._stdin.flush()
        answer = self._stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server died:\n{self.log.read_text()[-3000:]}")
        pid = int(json.loads(answer)["pid"])
        return Forked(pid, self.status / f"{pid}.rc", [sys.executable, *argv], self)

    def close(self) -> None:
        try:
            self._stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.status, ignore_errors=True)


_servers: Dict[int, Server] = {}


def enabled() -> bool:
    return os.environ.get("PIPECKPT_TEST_FORK", "1") != "0"


def _server(parity: int) -> Server:
    """This process's server for ranks of ``parity``, started on first use."""
    from support.paths import REPO, launcher_free, worker_pythonpath

    server = _servers.get(parity)
    if server is None or not server.alive():
        env = launcher_free(os.environ)
        for name in ("PYTHONWARNINGS", "OMP_NUM_THREADS"):  # each request's own, in the child
            env.pop(name, None)
        # A hash seed of its own for each server: set orders differ between neighbouring ranks.
        seed = str(int.from_bytes(os.urandom(4), "little"))
        env.update(PYTHONPATH=worker_pythonpath(), PYTHONUNBUFFERED="1", PYTHONHASHSEED=seed)
        server = _servers[parity] = Server(env, REPO)
    return server


def start(worker: Path, args: Sequence[str], env: Dict[str, str], rank: int, cwd: Path, log: Path) -> Forked:
    """Forks ``python worker args`` as ``rank`` under ``env``, its output to ``log``."""
    return _server(rank % 2).fork([str(worker), *args], env, cwd, log, log)


def run(
    command: Sequence[str], *, cwd: Path, env: Optional[Dict[str, str]] = None, timeout: float
) -> "subprocess.CompletedProcess[str]":
    """``subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``
    for a ``command`` that starts with ``sys.executable``, forked (or run fresh when disabled)."""
    env = dict(os.environ if env is None else env)
    if not enabled() or command[0] != sys.executable:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="pipeckpt-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = _server(0).fork(list(command[1:]), env, cwd, out, err)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended since
                pass
            proc.wait()
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text()) from None
        return subprocess.CompletedProcess(list(command), code, out.read_text(), err.read_text())


@atexit.register
def _close_all() -> None:
    for server in _servers.values():
        server.close()
    _servers.clear()


# --- the server side -------------------------------------------------------------------------


def _serve(status: Path) -> None:
    import importlib
    import threading

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # transformers is a test extra: a child imports what it needs itself
            print(f"fork server: {name} not preloaded", file=sys.stderr)
    # A fork copies one thread: anything the imports started would be missing from every rank.
    assert threading.active_count() == 1, threading.enumerate()
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the server's own output goes to its log
    children: Dict[int, Path] = {}
    reply.write("ready\n")
    requests = sys.stdin.buffer.raw  # unbuffered: select() must see every request line
    pending = b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.02)
        _reap(children)
        if not readable:
            continue
        chunk = os.read(requests.fileno(), 1 << 20)
        if not chunk:
            break  # the tests are done
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            started, ready = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(started)
                _run_child(request, reply, ready)  # never returns
            os.close(ready)
            os.read(started, 1)  # its session exists: killpg(pid) reaches it from the answer on
            os.close(started)
            children[pid] = status / f"{pid}.rc"
            reply.write(json.dumps({"pid": pid}) + "\n")
    while children:  # ranks still running when the tests ended: reaped, not left as zombies
        _reap(children)
        time.sleep(0.05)


def _reap(children: Dict[int, Path]) -> None:
    """Collects every child that has ended and publishes its exit status (written whole, then
    renamed: a reader never sees a partial file)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            partial = path.with_suffix(".partial")
            partial.write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(partial, path)


def _run_child(request: Dict[str, Any], reply: Any, ready: int) -> None:
    """Becomes the requested process: a session of its own (then says so on ``ready``), the
    request's files, directory and environment, then the command as ``__main__``; exits with the
    command's status."""
    code = 1
    try:
        os.setsid()
        os.write(ready, b"s")
        os.close(ready)
        reply.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        out = os.open(request["stdout"], flags, 0o644)
        err = out if request["stderr"] == request["stdout"] else os.open(request["stderr"], flags, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _settings()
        code = _run_main(request["argv"])
    except BaseException:  # before the command ran: its log says why
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _settings() -> None:
    """What a fresh interpreter would read from this environment at start-up."""
    import warnings

    import torch
    from lightning_utilities.core.rank_zero import rank_zero_only

    for action in filter(None, os.environ.get("PYTHONWARNINGS", "").split(",")):
        if ":" in action:
            raise ValueError(f"the fork server takes PYTHONWARNINGS actions only, not {action!r}")
        warnings.simplefilter(action)  # type: ignore[arg-type]
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Lightning reads the rank from the environment once, at import (in the server, as rank 0).
    rank_zero_only.rank = 0  # type: ignore[attr-defined]
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if name in os.environ:
            rank_zero_only.rank = int(os.environ[name])  # type: ignore[attr-defined]
            break
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = given  # the request's path, as a fresh interpreter would have it


def _run_main(argv: List[str]) -> int:
    """Runs ``python argv`` in this process: a script, or ``-m module``; returns its exit status."""
    import runpy

    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file first
            sys.path[0] = os.getcwd()  # as for `python -m`
            sys.modules.pop(argv[1], None)  # run afresh as __main__, as `python -m` would
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as for `python script.py`
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # a hook the command installed prints it, as it would
        code = 1
    atexit._run_exitfuncs()  # what interpreter shutdown runs (stdlib; no public name for it)
    return code


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
