"""The processes of the kill -9 trials of tests/faults/test_kill_trials_distributed.py.

    python tests/faults/kill_worker_distributed.py kill PLAN.json     # the reference, then every trial killed
    python tests/faults/kill_worker_distributed.py resume PLAN.json   # every trial resumed from its newest

As in tests/faults/kill_worker.py, this process imports torch and Lightning once and never trains; each
training is two forked children, rank 0 and rank 1 of a fresh gloo world on a port of its own,
each one stage of the toy module under engine="distributed", saving a sharded checkpoint directory
every step through ModelCheckpoint (one batch per epoch, so every checkpoint sits on an epoch
boundary, where Lightning resumes exactly).

The kill points are kill_worker.py's Probe kinds, seen on one rank: a forward of any of its Linear
layers (recompute included), a gradient hook of one of its weights, its optimizer step's pre/post
hook, and three moments of a sharded save: `write_bytes` (inside a torch.save of the save, a DCP
shard's tensor or rank 0's meta file, after the fraction `v` of its bytes), `write_before_replace`
and `write_after_replace` (rank 0, just before / after the rename that puts the finished directory
in place). A trial names the ranks to kill; each kills itself at the event its fraction `u` picks
among its own eligible events of the reference run.

Each rank writes `<dir>/result.rank<R>.json` (events seen) and, when it finishes, `final.rank<R>.pt`
(the parameters it holds) and its output to `rank<R>.<phase>.log`; the parent writes
`<dir>/status-<phase>.json`: for each rank its signal or exit code, whether the parent had to kill it
after LAUNCH_TIMEOUT_S, and when it ended (time.time()).
"""

import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import lightning as L
import torch
from kill_worker import WRITE_KINDS, KillAfterBytes, Probe, ProbeCallback
from lightning.pytorch.callbacks import ModelCheckpoint
from support.toy import ToyModule, toy_loader
from support.trainers import QUIET

from pipeckpt import PipelineStrategy
from pipeckpt.state import sharded

WORLD = 2
LAUNCH_TIMEOUT_S = 150  # a whole training, both ranks, on a loaded 2-core machine
RANK_ONLY = {"write_before_replace": 0, "write_after_replace": 0}  # only rank 0 renames the directory
REAL_TORCH_SAVE = torch.save  # bound before the probes wrap torch.save in a child


def install_write_probes(probe: Probe) -> None:
    """Wraps torch.save and the sharded save's final rename in this (disposable) child."""
    real_save, real_swap = torch.save, sharded.swap_into_place

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        kill = probe.event("write_bytes")
        limit = probe.target["offset"] if kill else None
        probe.sizes.append(0)

        def count(n: int) -> None:
            probe.sizes[-1] += n

        real_save(obj, KillAfterBytes(f, limit, count), *args, **kwargs)

    def swap(tmp: Any, target: Any) -> None:
        probe.maybe_kill("write_before_replace")
        real_swap(tmp, target)
        probe.maybe_kill("write_after_replace")

    torch.save, sharded.swap_into_place = save, swap  # type: ignore[assignment]


def train(
    plan: Dict[str, Any],
    directory: str,
    rank: int,
    *,
    port: int,
    target: Optional[Dict[str, Any]],
    ckpt_path: Optional[str],
    phase: str,
) -> None:
    """One rank of one training, in a forked child."""
    log = os.open(os.path.join(directory, f"rank{rank}.{phase}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(WORLD),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    probe = Probe(target)
    install_write_probes(probe)
    trainer = L.Trainer(
        strategy=PipelineStrategy(
            engine="distributed", chunks=2, checkpoint=plan["mode"], timeout=plan["timeout"]
        ),
        devices=WORLD,
        max_epochs=plan["epochs"],
        **dict(QUIET, enable_checkpointing=True),  # the trials save through ModelCheckpoint
        use_distributed_sampler=False,
        callbacks=[
            ModelCheckpoint(  # the resume's own directory: the kill's stays as the kill left it
                dirpath=os.path.join(directory, "ckpt" if phase == "kill" else f"ckpt-{phase}"),
                every_n_train_steps=1,
                save_top_k=-1,
            ),
            ProbeCallback(probe),
        ],
    )
    module = ToyModule(dropout=plan["dropout"])
    # A resumed run must take every rank's RNG state from the checkpoint, not from this seed.
    torch.manual_seed(999 if ckpt_path else 123)
    trainer.fit(module, toy_loader(n=16, batch_size=16), ckpt_path=ckpt_path)
    result = {"events": probe.events, "sizes": probe.sizes, "global_step": trainer.global_step}
    with open(os.path.join(directory, f"result.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    held = {k: v.detach().clone() for k, v in module.state_dict().items() if not v.is_meta}
    REAL_TORCH_SAVE(held, os.path.join(directory, f"final.rank{rank}.pt"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run: Callable[[int], None], directory: str, phase: str) -> None:
    """Runs run(rank) in one forked child per rank; records how and when each ended in
    <directory>/status-<phase>.json. Children still running after LAUNCH_TIMEOUT_S are killed."""
    os.makedirs(directory, exist_ok=True)
    sys.stdout.flush()
    pids: List[int] = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:  # the child: never return into the parent's code
            code = 1
            try:
                run(rank)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    fired = threading.Event()

    def too_late() -> None:
        fired.set()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    deadline = threading.Timer(LAUNCH_TIMEOUT_S, too_late)
    deadline.start()
    ended: Dict[int, Dict[str, Any]] = {}
    while len(ended) < WORLD:
        pid, status = os.wait()  # whichever ends first: each end time is when it ended
        ended[pids.index(pid)] = {
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "timed_out": fired.is_set(),
            "ended": time.time(),
        }
    deadline.cancel()
    deadline.join()  # no thread alive at the next fork
    with open(os.path.join(directory, f"status-{phase}.json"), "w") as f:
        json.dump([ended[rank] for rank in range(WORLD)], f)


def kill_targets(reference: List[Dict[str, Any]], trial: Dict[str, Any]) -> Dict[str, Any]:
    """For each rank to kill, the event the trial's fractions pick among that rank's eligible events
    in the reference run: training events once the first checkpoint exists (global step >= 1),
    checkpoint writes once a complete one exists (global step >= 2)."""
    kind = trial["kind"]
    first_step = 2 if kind in WRITE_KINDS else 1
    targets = {}
    for rank in trial["ranks"]:
        eligible = [i for i, step in enumerate(reference[rank]["events"][kind]) if step >= first_step]
        if not eligible:
            raise SystemExit(
                f"rank {rank} of the reference run had no {kind!r} event at step >= {first_step}"
            )
        index = eligible[int(trial["u"] * len(eligible))]
        target: Dict[str, Any] = {"kind": kind, "index": index}
        if kind == "write_bytes":
            target["offset"] = int(trial["v"] * reference[rank]["sizes"][index])
        targets[str(rank)] = target
    return targets


def main(phase: str, plan_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    ref = plan["reference_dir"]
    if phase == "kill":
        run = functools.partial(train, plan, ref, port=free_port(), target=None, ckpt_path=None, phase=phase)
        launch(run, ref, phase)
        reference = []
        for rank in range(WORLD):
            with open(os.path.join(ref, f"result.rank{rank}.json")) as f:
                reference.append(json.load(f))
        for trial in plan["trials"]:
            targets = kill_targets(reference, trial)
            os.makedirs(trial["dir"], exist_ok=True)
            with open(os.path.join(trial["dir"], "targets.json"), "w") as f:
                json.dump(targets, f)
            port = free_port()

            def one(
                rank: int, trial: Dict[str, Any] = trial, targets: Dict[str, Any] = targets, port: int = port
            ) -> None:
                target = targets.get(str(rank))
                train(plan, trial["dir"], rank, port=port, target=target, ckpt_path=None, phase=phase)

            launch(one, trial["dir"], phase)
    elif phase == "resume":
        for trial in plan["trials"]:
            run = functools.partial(
                train,
                plan,
                trial["dir"],
                port=free_port(),
                target=None,
                ckpt_path=trial["resume_from"],
                phase=phase,
            )
            launch(run, trial["dir"], phase)
    else:
        raise SystemExit(f"unknown phase {phase!r}: use 'kill' or 'resume'")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
