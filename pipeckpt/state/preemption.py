"""SLURM's preemption warning answered at a step boundary, never inside the step.

Why not Lightning's handler (``_SignalConnector``): it saves inside the signal handler, in the middle
of whatever ran; under the distributed engine that deadlocks on in-flight collectives. Here the
handler only records the request; after each optimizer step the ranks agree on it (an all-reduce,
or the step's own collective when an engine carries the request in it: :meth:`PreemptionCallback.carry`),
every rank saves ``hpc_ckpt_N.ckpt``, rank 0 runs ``scontrol requeue``, and every rank leaves ``fit``
with :class:`Preempted` (exit code 0); the requeued job resumes through Lightning's own path
(docs/DESIGN.md, state/preemption).
"""

import logging
import os
import re
import signal
import subprocess
import threading
from types import FrameType
from typing import Any, Callable, List, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint

from pipeckpt._compat import hpc_checkpoint_path

__all__ = ["Preempted", "PreemptionCallback", "install", "stop_requests"]

log = logging.getLogger(__name__)

_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, None]


class Preempted(SystemExit):
    """Raised on every rank once the hpc checkpoint is saved and the job requeued: ``fit`` ends,
    and so does the process unless something catches it. ``code`` is 0, or 1 if the requeue failed."""

    def __init__(self, *, step: int, path: str, requeued: bool) -> None:
        super().__init__(0 if requeued else 1)
        self.step = step
        self.path = path
        self.requeued = requeued


class PreemptionCallback(Callback):
    """Records ``signum`` in its handler and acts on it at the next optimizer-step boundary."""

    def __init__(self, *, signum: int) -> None:
        self.signum = signum
        self.requested = False
        self._previous: _Handler = None
        self._installed = False
        self._closed = False
        self._step_at_batch_start = -1
        self._carried: Optional[bool] = None  # agreed within a step's own collective (see carry)

    # -- the handler -------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if self._closed:
            _forward(self._previous, signum, frame)
            return
        # Nothing else here: no I/O (a print interrupted by the signal would re-enter the stream),
        # no collective, no checkpoint. The step boundary does the work.
        self.requested = True

    def install_handler(self) -> bool:
        """Installs the recording handler unless the user installed one of their own (Lightning's
        rule too); False when it did not. Only the main thread may set handlers."""
        if threading.current_thread() is not threading.main_thread():
            return False
        current = signal.getsignal(self.signum)
        ours = getattr(current, "__self__", None)
        if current not in (None, signal.SIG_DFL) and not isinstance(ours, PreemptionCallback):
            log.info(f"pipeckpt: signal {self.signum} already has a handler; preemption left to it")
            return False
        # A handler of ours left from a fit that raised (see `on_exception`) knows the real previous one.
        self._previous = ours._previous if isinstance(ours, PreemptionCallback) else current
        self._closed = False
        signal.signal(self.signum, self._on_signal)
        # Restart system calls the signal interrupts (gloo's socket reads among them) instead of
        # failing them with EINTR: the handler has nothing to say to the interrupted code.
        signal.siginterrupt(self.signum, False)
        self._installed = True
        return True

    def restore_handler(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    # -- the step boundary ------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_at_batch_start:
            return  # accumulating gradients: the optimizer has not stepped, so no rank checks here
        if self._agreed_at_boundary(trainer):
            self._preempt(trainer)

    def forget(self) -> None:
        """A new fit: no request recorded or agreed yet."""
        self.requested = False
        self._carried = None

    def carry(self, agreed: bool) -> None:
        """The request of any rank, as every rank of the world agreed on it inside a collective the
        training step made anyway (an engine's): the next step boundary reads it instead of making
        a collective of its own. Every rank must be told at the same steps."""
        self._carried = agreed or bool(self._carried)

    def _agreed_at_boundary(self, trainer: Trainer) -> bool:
        """The request agreed since the last boundary: carried by the steps, else agreed now."""
        carried, self._carried = self._carried, None
        return carried if carried is not None else self._agreed(trainer)

    def _agreed(self, trainer: Trainer) -> bool:
        """The request of any rank, on every rank (a collective when there are several), or one
        carried by a step since the last boundary."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested or bool(self._carried)
        flag = torch.tensor([int(self.requested)], dtype=torch.int32, device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item()) or bool(self._carried)

    def _preempt(self, trainer: Trainer) -> None:
        path = trainer.strategy.broadcast(hpc_checkpoint_path(trainer), src=0)  # one name on every rank
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # see the module's docstring
        for logger in trainer.loggers:
            logger.finalize("finished")
        # the whole state; every rank's part is written when it returns (Lightning's barrier)
        trainer.save_checkpoint(path, weights_only=False)
        requeued = requeue() if trainer.is_global_zero else True
        print(
            f"pipeckpt: rank {trainer.global_rank} preempted: saved {path} at global_step="
            f"{trainer.global_step}" + ("; job requeued" if trainer.is_global_zero and requeued else ""),
            flush=True,
        )
        raise Preempted(step=trainer.global_step, path=str(path), requeued=requeued)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._closed = True
        self.restore_handler()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning's teardown, which comes next, puts back the handlers it found when the fit
        # started, ours among them, and no hook of ours runs after it: from now on ours hands
        # every signal to the handler it replaced.
        self._closed = True
        self.restore_handler()


def _forward(handler: _Handler, signum: int, frame: Optional[FrameType]) -> None:
    """What ``handler`` would have done with the signal."""
    if callable(handler):
        handler(signum, frame)
    elif handler in (None, signal.SIG_DFL):
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def slurm_job_id() -> Optional[str]:
    """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for an array task, else the job id."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array is not None:
        return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue() -> bool:
    """Runs ``scontrol requeue`` for this job; whether it succeeded (a failure is printed)."""
    job = slurm_job_id()
    if job is None or not re.fullmatch(r"[0-9_]+", job):
        print(f"pipeckpt: cannot requeue: no SLURM job id in the environment ({job!r})", flush=True)
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        print(f"pipeckpt: `scontrol requeue {job}` could not run: {error}", flush=True)
        return False
    if result.returncode != 0:
        print(
            f"pipeckpt: `scontrol requeue {job}` failed ({result.returncode}): {result.stderr.strip()}",
            flush=True,
        )
        return False
    print(f"pipeckpt: requeued SLURM job {job}", flush=True)
    return True


def stop_requests(trainer: Trainer) -> List[PreemptionCallback]:
    """The callbacks of ``trainer`` that answer a stop request at step boundaries (SLURM's signal,
    SIGTERM), in the order of its callbacks (the same on every rank)."""
    callbacks: List[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared
    return [c for c in callbacks if isinstance(c, PreemptionCallback)]


def install(trainer: Trainer, environment: Optional[ClusterEnvironment]) -> Optional[PreemptionCallback]:
    """Answers SLURM's requeue signal at step boundaries in this ``fit``; called by the strategy.

    Does nothing unless Lightning would auto-requeue (a ``SLURMEnvironment`` with
    ``auto_requeue``), so ``SLURMEnvironment(auto_requeue=False)`` still turns requeueing off.
    """
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return None
    signum = environment.requeue_signal
    if signum is None:
        return None
    callbacks: List[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared
    for existing in callbacks:
        if isinstance(existing, PreemptionCallback) and existing.signum == signum:
            existing.forget()
            return existing if existing.install_handler() else None
    callback = PreemptionCallback(signum=int(signum))
    if not callback.install_handler():
        return None
    # Before the checkpoint callbacks, as Lightning orders callbacks (checkpoints last).
    first_checkpoint = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
    callbacks.insert(first_checkpoint, callback)
    return callback
