"""Liveness.diagnose: how a survivor accounts for the other ranks, from facts in the store and the
kernel, with no fixed wait. One in-memory store stands for the rendezvous store; the "other rank"
is a real process (sleep) whose identity is published the way Liveness.start publishes its own."""

import json
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest
import torch.distributed as dist

from pipeckpt.engines.distributed.liveness import Liveness, _node, _stat, process_exists

WITHIN_S = 20.0  # a deadline that none of the fast verdicts below may wait out


@pytest.fixture
def store() -> dist.Store:
    return dist.HashStore()


@pytest.fixture
def other() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def publish(store: dist.Store, rank: int, where: dict) -> dist.Store:
    prefixed = dist.PrefixStore("pipeckpt/liveness/", store)
    prefixed.set(f"process/{rank}", json.dumps(where))
    prefixed.add(f"beat/{rank}", 1)
    return prefixed


def identity(proc: subprocess.Popen) -> dict:
    stat = _stat(proc.pid)
    assert stat is not None
    return {"node": _node(), "pid": proc.pid, "start": stat[19]}


def me(store: dist.Store) -> Liveness:
    return Liveness(store, rank=0, world_size=2, period=0.5)


def test_a_rank_whose_process_exists_on_this_node_is_alive_at_once(store, other):
    publish(store, 1, identity(other))
    found = me(store).diagnose(within=WITHIN_S)
    assert (found.errors, found.lost) == ({}, [])
    assert found.elapsed_s < WITHIN_S


def test_a_rank_whose_process_was_reaped_is_lost_at_once(store, other):
    publish(store, 1, identity(other))
    other.kill()
    other.wait()
    found = me(store).diagnose(within=WITHIN_S)
    assert (found.errors, found.lost) == ({}, [1])
    assert found.elapsed_s < WITHIN_S


def test_a_killed_rank_that_is_still_a_zombie_is_lost(store, other):
    publish(store, 1, identity(other))
    other.kill()
    while _stat(other.pid)[0] != "Z":  # not reaped: its parent (this test) has not waited yet
        time.sleep(0.01)
    assert me(store).diagnose(within=WITHIN_S).lost == [1]


def test_a_reused_pid_is_not_taken_for_the_rank(other):
    where = dict(identity(other), start="0")  # the rank's process started at another time
    assert process_exists(where) is False


def test_a_rank_on_another_node_is_not_judged_by_this_nodes_processes(other):
    assert process_exists(dict(identity(other), node="another-node")) is None


def test_a_rank_on_another_node_whose_counter_moves_is_alive(store):
    prefixed = publish(store, 1, {"node": "another-node", "pid": 1, "start": "0"})
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            prefixed.add("beat/1", 1)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        found = me(store).diagnose(within=WITHIN_S)
    finally:
        stop.set()
        thread.join()
    assert found.lost == [] and found.elapsed_s < WITHIN_S


def test_a_silent_rank_on_another_node_is_lost_once_the_deadline_passes(store):
    publish(store, 1, {"node": "another-node", "pid": 1, "start": "0"})
    found = me(store).diagnose(within=1.0)
    assert found.lost == [1] and found.elapsed_s >= 1.0


def test_a_rank_that_said_it_left_is_neither_lost_nor_waited_for(store, other):
    prefixed = publish(store, 1, identity(other))
    other.kill()
    other.wait()
    prefixed.set("left/1", "1")
    found = me(store).diagnose(within=WITHIN_S)
    assert found.lost == [] and found.elapsed_s < WITHIN_S


def test_a_rank_that_raised_is_quoted(store, other):
    prefixed = publish(store, 1, identity(other))
    error = {"type": "ValueError", "message": "no", "traceback": "Traceback ..."}
    prefixed.set("error/1", json.dumps(error))
    assert me(store).diagnose(within=WITHIN_S).errors == {1: error}


def test_a_rank_that_never_published_where_it_runs_is_judged_by_its_beats(store):
    found = me(store).diagnose(within=0.5)  # no process/1, no beat/1: silent
    assert found.lost == [1]


# A process whose beat is inside a real store call at exit. Before stop() waited for the beat (and
# ran at exit), about half of such exits aborted with "terminate called without an active
# exception" (a daemon thread re-taking the GIL during finalisation, in torch's binding); the beat
# below calls the store back to back, so that an exit nearly always finds it inside a call.
EXITS = 6
EXIT_WHILE_BEATING = """
import datetime, time
import torch.distributed as dist
from pipeckpt.engines.distributed.liveness import Liveness
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
Liveness(store, rank=0, world_size=1, period=1e-5).start()
time.sleep(0.2)
"""


def test_a_process_that_exits_while_its_beat_is_inside_a_store_call_exits_cleanly():
    procs = [
        subprocess.Popen([sys.executable, "-c", EXIT_WHILE_BEATING], stderr=subprocess.PIPE, text=True)
        for _ in range(EXITS)
    ]
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * EXITS, errors  # an abort is -6 (SIGABRT)
