"""SIGTERM answered like SLURM's preemption warning: a checkpoint at the next step boundary, then exit 143;
while the model is being loaded, before any step, a line saying so, then exit 143.

Why: Lightning's own handler raises ``SIGTERMException``, a ``SystemExit`` with no code, so an
interrupted run exits 0 with no checkpoint (and under the distributed engine starts a broadcast
inside the handler). Here the handler only records the signal (as
:class:`pipeckpt.state.preemption.PreemptionCallback` does), the ranks agree on it after each
optimizer step, every rank saves (the last checkpoint of a ``save_last`` ModelCheckpoint, under the
name it gives this run, else Lightning's ``hpc_ckpt_N.ckpt``), and the process exits with 143
(128 + SIGTERM). A SIGTERM after training ends is left to the handler that was there before, so
the exit is non-zero whenever it came.

While the strategy sets the model up (:func:`stop_on_sigterm`: a pretrained model's weights being
read, its stages made real) there is no step boundary to wait for and nothing to save: a SIGTERM
stops the process at once, with one line naming what it was doing and exit 143, and is passed on to
the ranks this process launched. Without it the process died silently of the signal, and the
launcher's watch of a rank that did read as a failure (:mod:`pipeckpt.engines.distributed.children`).
"""

import signal
import subprocess
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Any, Iterator, List, Optional, Sequence

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

from pipeckpt._compat import hpc_checkpoint_path, last_checkpoint_path
from pipeckpt.state.preemption import Preempted, PreemptionCallback

__all__ = [
    "EXIT_CODE",
    "Stopped",
    "Terminated",
    "TerminationCallback",
    "install",
    "stop_on_sigterm",
    "stopping",
]

EXIT_CODE = 128 + signal.SIGTERM
_CHILDREN_S = 30.0  # how long a stopped process waits for the ranks it launched to say why they stop
_stopping = threading.Event()  # this process answers a SIGTERM: it saves, or stops, and exits 143


def stopping() -> bool:
    """Whether this process is on its way out after a SIGTERM (its launcher's watch leaves it be)."""
    return _stopping.is_set()


class Terminated(Preempted):
    """Raised on every rank once the checkpoint is saved after a SIGTERM; ``code`` is 143."""

    def __init__(self, *, step: int, path: str) -> None:
        super().__init__(step=step, path=path, requeued=False)
        self.code = EXIT_CODE


def _target(trainer: Trainer) -> str:
    """This run's last checkpoint of the first ``save_last`` ModelCheckpoint (what a user resumes
    from; ``last-v1.ckpt`` when another run owns ``last.ckpt``), else the next ``hpc_ckpt_N.ckpt``.
    A collective: every rank calls it."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath is not None:
            path = last_checkpoint_path(callback, trainer)
            callback.last_model_path = path  # the run's own from now on, as if the callback had saved it
            return path
    return hpc_checkpoint_path(trainer)


class TerminationCallback(PreemptionCallback):
    """Records SIGTERM in its handler and saves and exits at the next optimizer-step boundary."""

    def __init__(self) -> None:
        super().__init__(signum=signal.SIGTERM)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning wrapped its own SIGTERM handler around ours as the fit began; ours alone decides.
        if self._installed:
            signal.signal(self.signum, self._on_signal)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._agreed(trainer):  # the signal came after the last step's boundary
            self._preempt(trainer)

    def _preempt(self, trainer: Trainer) -> None:
        path = trainer.strategy.broadcast(_target(trainer), src=0)  # one name on every rank
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the save
        _stopping.set()
        for logger in trainer.loggers:
            logger.finalize("finished")
        trainer.save_checkpoint(path, weights_only=False)  # the whole state, to resume from
        print(
            f"pipeckpt: rank {trainer.global_rank} terminated by SIGTERM: saved {path} at "
            f"global_step={trainer.global_step}; exiting with {EXIT_CODE}",
            flush=True,
        )
        raise Terminated(step=trainer.global_step, path=str(path))


def install(trainer: Trainer) -> Optional[TerminationCallback]:
    """Answers SIGTERM at step boundaries in this ``fit``; called by the strategy. Leaves a SIGTERM
    handler the user installed alone."""
    callbacks: List[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared
    for existing in callbacks:
        if isinstance(existing, TerminationCallback):
            existing.forget()
            return existing if existing.install_handler() else None
    callback = TerminationCallback()
    if not callback.install_handler():
        return None
    first_checkpoint = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
    callbacks.insert(first_checkpoint, callback)
    return callback


class Stopped(SystemExit):
    """Raised where a SIGTERM found this process setting its model up: ``code`` is 143."""

    def __init__(self, line: str) -> None:
        super().__init__(EXIT_CODE)
        self.line = line


@contextmanager
def stop_on_sigterm(rank: int, what: str, children: Sequence["subprocess.Popen[Any]"] = ()) -> Iterator[None]:
    """Inside, a SIGTERM stops this process (global rank ``rank``, doing ``what``: "loading the model
    ..."): it is passed on to ``children`` (the ranks this process launched), :class:`Stopped` is
    raised where the process was, its line printed, and the children waited for (at most
    :data:`_CHILDREN_S`), so that the job ends once every rank has said why. A handler the user
    installed is left alone, as is SIGTERM outside the main thread."""
    previous = signal.getsignal(signal.SIGTERM)
    ours = isinstance(getattr(previous, "__self__", None), PreemptionCallback)  # left by an earlier fit
    if threading.current_thread() is not threading.main_thread() or not (
        ours or previous in (None, signal.SIG_DFL)
    ):
        yield
        return

    def stop(signum: int, frame: Optional[FrameType]) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one answer while it unwinds to here
        _stopping.set()
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        raise Stopped(
            f"pipeckpt: rank {rank} stopped by SIGTERM while {what}, before the first step: nothing "
            f"was trained or saved; exiting with {EXIT_CODE}"
        )

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except Stopped as stopped:
        print(stopped.line, flush=True)
        for child in children:
            try:
                child.wait(timeout=_CHILDREN_S)
            except subprocess.TimeoutExpired:
                pass  # the launcher's watch ends it
        raise
    finally:
        if signal.getsignal(signal.SIGTERM) in (stop, signal.SIG_IGN):
            signal.signal(signal.SIGTERM, previous)
