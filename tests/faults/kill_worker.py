"""The processes of the kill -9 trials of tests/faults/test_kill_trials.py.

    python tests/faults/kill_worker.py kill PLAN.json     # the reference run, then every trial killed
    python tests/faults/kill_worker.py resume PLAN.json   # every trial resumed from its chosen checkpoint

Importing torch and Lightning costs seconds on a small machine, so this process imports them once
and forks one child per training (it never trains itself, so the children start from a clean,
single-threaded parent). A child trains the toy module of toy.py on the local pipeline engine with
`AtomicCheckpointIO` and a `ModelCheckpoint` that saves every step; one batch per epoch, so every
checkpoint sits on an epoch boundary, where Lightning resumes exactly.

The reference child counts events of each kind and the global step at each; a trial child SIGKILLs
itself at the event the plan's fraction `u` picks among the eligible ones (those after a complete
checkpoint exists), so a failing trial reproduces from its plan entry. Kinds:

    forward              a forward call of any layer (recomputation included)
    backward             a gradient hook of any Linear weight
    optimizer_pre/post   the optimizer's step pre- / post-hook (post: parameters updated, not saved)
    write_bytes          inside torch.save, after the fraction `v` of the checkpoint's bytes
    write_before_replace the temporary file complete, just before os.replace
    write_after_replace  just after os.replace, before the directory fsync

Each child writes `<dir>/result.json` (events seen; reference and resume also `final.pt`, the final
parameters); the parent writes `<dir>/status-<phase>.json` with how the child ended.
"""

import functools
import json
import os
import signal
import sys
import threading
from typing import Any, BinaryIO, Callable, Dict, List, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from support.toy import ToyModule, toy_loader
from support.trainers import QUIET

from pipeckpt import PipelineStrategy
from pipeckpt.state.files import AtomicCheckpointIO

WRITE_KINDS = ("write_bytes", "write_before_replace", "write_after_replace")
KINDS = ("forward", "backward", "optimizer_pre", "optimizer_post", *WRITE_KINDS)
CHILD_TIMEOUT_S = 120
REAL_TORCH_SAVE = torch.save  # bound before the probes wrap torch.save in a child


def kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Probe:
    """Counts events per kind (with the global step of each) and kills at the target one."""

    def __init__(self, target: Optional[Dict[str, Any]]) -> None:
        self.target = target
        self.events: Dict[str, List[int]] = {kind: [] for kind in KINDS}
        self.sizes: List[int] = []  # bytes of each torch.save, in order
        self.trainer: Optional[L.Trainer] = None
        self.lock = threading.Lock()  # forward hooks may run in the engine's worker threads

    def event(self, kind: str) -> bool:
        """Records one event; True when it is the one to kill at."""
        with self.lock:
            index = len(self.events[kind])
            self.events[kind].append(self.trainer.global_step if self.trainer is not None else -1)
        return self.target is not None and self.target["kind"] == kind and self.target["index"] == index

    def maybe_kill(self, kind: str) -> None:
        if self.event(kind):
            kill_now()


class KillAfterBytes:
    """A file that SIGKILLs the process once `limit` bytes have gone through it."""

    def __init__(self, file: BinaryIO, limit: Optional[int], count: Callable[[int], None]) -> None:
        self.file, self.limit, self.count, self.written = file, limit, count, 0

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self.limit is not None and self.written + size > self.limit:
            self.file.write(memoryview(data).cast("B")[: self.limit - self.written])
            self.file.flush()
            kill_now()
        self.written += size
        self.count(size)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def install_write_probes(probe: Probe) -> None:
    """Wraps torch.save and os.replace in this (disposable) child process."""
    real_save, real_replace = torch.save, os.replace

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        kill = probe.event("write_bytes")
        limit = probe.target["offset"] if kill else None
        probe.sizes.append(0)

        def count(n: int) -> None:
            probe.sizes[-1] += n

        real_save(obj, KillAfterBytes(f, limit, count), *args, **kwargs)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        probe.maybe_kill("write_before_replace")
        real_replace(src, dst, **kwargs)
        probe.maybe_kill("write_after_replace")

    torch.save, os.replace = save, replace


class ProbeCallback(Callback):
    """Installs the training-side probes once the trainer has its optimizer."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        probe = self.probe
        probe.trainer = trainer
        for layer in pl_module.layers.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_hook(lambda *_: probe.maybe_kill("forward"))
                layer.weight.register_hook(lambda grad: probe.maybe_kill("backward"))
        optimizer = trainer.optimizers[0]
        optimizer.register_step_pre_hook(lambda *_: probe.maybe_kill("optimizer_pre"))
        optimizer.register_step_post_hook(lambda *_: probe.maybe_kill("optimizer_post"))


def train(
    plan: Dict[str, Any], directory: str, *, target: Optional[Dict[str, Any]], ckpt_path: Optional[str]
) -> None:
    """One training run of the plan's settings in a child process."""
    probe = Probe(target)
    install_write_probes(probe)
    checkpoints = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_last=True)
    trainer = L.Trainer(
        strategy=PipelineStrategy(stages=2, chunks=2, checkpoint=plan["mode"]),
        plugins=[AtomicCheckpointIO()],
        devices=1,
        max_epochs=plan["epochs"],
        **dict(QUIET, enable_checkpointing=True),  # the trials save through ModelCheckpoint
        callbacks=[checkpoints, ProbeCallback(probe)],
    )
    # A resumed run must take its RNG state from the checkpoint, not from this seed.
    torch.manual_seed(999 if ckpt_path else 123)
    module = ToyModule(dropout=plan["dropout"])
    trainer.fit(module, toy_loader(n=16, batch_size=16), ckpt_path=ckpt_path)
    result = {"events": probe.events, "sizes": probe.sizes, "global_step": trainer.global_step}
    with open(os.path.join(directory, "result.json"), "w") as f:
        json.dump(result, f)
    if target is None:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        REAL_TORCH_SAVE(state, os.path.join(directory, "final.pt"))


def in_child(fn: Callable[[], None], directory: str, phase: str) -> None:
    """Runs fn in a forked child; records how it ended in <directory>/status-<phase>.json."""
    os.makedirs(directory, exist_ok=True)
    pid = os.fork()
    if pid == 0:  # the child: never return into the parent's code
        code = 1
        try:
            fn()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    fired = threading.Event()

    def too_late() -> None:
        fired.set()
        os.kill(pid, signal.SIGKILL)

    deadline = threading.Timer(CHILD_TIMEOUT_S, too_late)
    deadline.start()
    _, status = os.waitpid(pid, 0)
    deadline.cancel()
    deadline.join()  # no thread alive at the next fork
    timed_out = fired.is_set()
    ended = {
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "timed_out": timed_out,
    }
    with open(os.path.join(directory, f"status-{phase}.json"), "w") as f:
        json.dump(ended, f)


def kill_target(reference: Dict[str, Any], trial: Dict[str, Any]) -> Dict[str, Any]:
    """The event the trial's fractions pick among the reference run's eligible events:
    training events once the first checkpoint exists (global step >= 1), checkpoint writes
    once a complete one exists (global step >= 2)."""
    kind = trial["kind"]
    first_step = 2 if kind in WRITE_KINDS else 1
    eligible = [i for i, step in enumerate(reference["events"][kind]) if step >= first_step]
    if not eligible:
        raise SystemExit(f"the reference run had no {kind!r} event at global step >= {first_step}")
    index = eligible[int(trial["u"] * len(eligible))]
    target = {"kind": kind, "index": index}
    if kind == "write_bytes":
        target["offset"] = int(trial["v"] * reference["sizes"][index])
    return target


def main(phase: str, plan_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    reference_dir = plan["reference_dir"]
    if phase == "kill":
        in_child(lambda: train(plan, reference_dir, target=None, ckpt_path=None), reference_dir, phase)
        with open(os.path.join(reference_dir, "result.json")) as f:
            reference = json.load(f)
        for trial in plan["trials"]:
            target = kill_target(reference, trial)
            with open(os.path.join(_mkdir(trial["dir"]), "target.json"), "w") as f:
                json.dump(target, f)
            run = functools.partial(train, plan, trial["dir"], target=target, ckpt_path=None)
            in_child(run, trial["dir"], phase)
    elif phase == "resume":
        for trial in plan["trials"]:
            run = functools.partial(train, plan, trial["dir"], target=None, ckpt_path=trial["resume_from"])
            in_child(run, trial["dir"], phase)
    else:
        raise SystemExit(f"unknown phase {phase!r}: use 'kill' or 'resume'")


def _mkdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
