"""The training run of the preemption tests: SIGUSR1 at chosen moments inside steps, on chosen ranks.

    srun -J preempt -N2 --ntasks-per-node=1 python tests/slurm/preempt_job.py OUT --engine distributed
    python tests/slurm/preempt_job.py OUT --engine local        # the uninterrupted reference, no SLURM

Test-only, like faults.py: the test decides when a signal arrives, through one variable,
``PIPECKPT_TEST_PREEMPT`` = ``restart:rank:offset:phase:delivery`` entries joined by ``,``. In the run
whose ``SLURM_RESTART_COUNT`` is ``restart``, rank ``rank`` (``all``: every rank) sends the signal in
the step that starts ``offset`` steps after the run resumed, during ``phase``:

    forward     the first forward of one of this rank's layers (a forward pre-hook)
    backward    the first gradient of one of this rank's parameters (a tensor hook)
    optimizer   the optimizer step (a step pre-hook)
    checkpoint  ModelCheckpoint's save at that step's end (``on_save_checkpoint``, before the write)

``delivery`` ``self``: ``os.kill`` of this process, so the handler runs exactly there; ``scancel``:
``scancel --signal=USR1 JOB`` as SLURM delivers it, to every task, a moment later.

Everything that could differ between an interrupted and an uninterrupted run is pinned down: the
model has dropout (each rank's RNG must be restored), each epoch's order is drawn from a seed, the
loader resumes mid-epoch (:class:`ResumableLoader`) and draws nothing from the global RNG. At the
end every rank writes the parameters it holds to ``OUT/final/rank{R}.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

PHASES = ("forward", "backward", "optimizer", "checkpoint")


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.1),
            nn.Linear(32, 1),
        )  # fmt: skip

    def configure_pipeline(self) -> nn.Sequential:
        return self.net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class EpochSampler(Sampler[int]):
    """A permutation drawn from ``seed + epoch``: the same order for an epoch in every run."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it when an epoch starts
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class ResumableLoader(DataLoader):
    """A loader Lightning resumes mid-epoch (it has ``state_dict``/``load_state_dict``): the state
    is the epoch and how many of its batches were handed out (Lightning fetches a sized loader's
    batches as training asks for them, so that is how many training used)."""

    def __init__(self, dataset: TensorDataset, *, batch_size: int, seed: int) -> None:
        self.order = EpochSampler(len(dataset), seed)
        super().__init__(
            dataset, batch_size=batch_size, sampler=self.order, drop_last=True, generator=torch.Generator()
        )
        self._handed_out = 0
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()
        for _ in range(self._skip):
            next(batches)
        self._handed_out, self._skip = self._skip, 0

        def counted() -> Iterator[Any]:
            for batch in batches:
                self._handed_out += 1
                yield batch

        return counted()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.order.epoch, "used": self._handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["used"] >= len(self):  # saved at the epoch's last batch: the next epoch comes
            self.order.set_epoch(state["epoch"] + 1)
        else:
            self.order.set_epoch(state["epoch"])
            self._skip = state["used"]


def data() -> ResumableLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return ResumableLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16, seed=7)


def plan() -> list[tuple[str, int, str, str]]:
    """This run's signals: (rank, offset, phase, delivery), from PIPECKPT_TEST_PREEMPT."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    entries = [e.split(":") for e in os.environ.get("PIPECKPT_TEST_PREEMPT", "").split(",") if e]
    return [(rank, int(offset), phase, how) for r, rank, offset, phase, how in entries if r == restart]


class SignalInjection(Callback):
    """Sends the planned signal at the planned moment; prints where each run starts and ends."""

    def __init__(self) -> None:
        self.plan = plan()
        self.armed: list[tuple[str, str]] = []  # (phase, delivery) armed for this step
        self.start_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_step = trainer.global_step
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        print(
            f"preempt: start rank={trainer.global_rank} global_step={trainer.global_step} restart={restart}"
        )
        mine = [p for p in pl_module.net.parameters() if p.device.type != "meta"]
        for layer in pl_module.net:
            if any(p.device.type != "meta" for p in layer.parameters()):
                layer.register_forward_pre_hook(lambda *_: self._fire("forward"))
        for p in mine:
            p.register_hook(lambda grad: self._fire("backward"))
        trainer.optimizers[0].register_step_pre_hook(lambda *_: self._fire("optimizer"))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int) -> None:
        self.armed = [
            (phase, how)
            for rank, offset, phase, how in self.plan
            if rank in ("all", str(trainer.global_rank)) and trainer.global_step == self.start_step + offset
        ]
        self.step = trainer.global_step

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: Any) -> None:
        self._fire("checkpoint")

    def _fire(self, phase: str) -> None:
        for armed in [a for a in self.armed if a[0] == phase]:
            self.armed.remove(armed)
            how = armed[1]
            print(
                f"preempt: signal phase={phase} step={self.step} delivery={how} time={time.time():.3f}",
                flush=True,
            )
            if how == "self":
                os.kill(os.getpid(), signal.SIGUSR1)
            else:
                # scancel runs inside the job, so the signal it sends reaches it too when it has not
                # exited yet: dying of SIGUSR1 is the delivery having happened, not a failure
                done = subprocess.run(["scancel", "--signal=USR1", os.environ["SLURM_JOB_ID"]], timeout=60)
                if done.returncode not in (0, -signal.SIGUSR1):
                    raise subprocess.CalledProcessError(done.returncode, done.args)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        held = {
            k: v.detach().clone() for k, v in pl_module.net.state_dict().items() if v.device.type != "meta"
        }
        final = Path(trainer.default_root_dir) / "final"
        final.mkdir(parents=True, exist_ok=True)
        torch.save(held, final / f"rank{trainer.global_rank}.pt")
        print(f"preempt: end rank={trainer.global_rank} global_step={trainer.global_step}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--engine", choices=["local", "distributed"], default="distributed")
    args = parser.parse_args()

    from pipeckpt import PipelineStrategy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    distributed = args.engine == "distributed"
    strategy = PipelineStrategy(engine="distributed") if distributed else PipelineStrategy(balance=[4, 3])
    trainer = Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=int(os.environ.get("SLURM_NTASKS_PER_NODE", 2 if distributed else 1)),
        num_nodes=int(os.environ.get("SLURM_NNODES", 1)),
        max_steps=args.steps,
        default_root_dir=args.out_dir,
        logger=False,
        use_distributed_sampler=False,  # one pipeline: every rank reads the same batches
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(args.out_dir, "checkpoints"), every_n_train_steps=1),
            SignalInjection(),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), data())


if __name__ == "__main__":
    main()
