"""A tiny training run for the SLURM and fault tests, with plain DDP or pipeckpt's pipeline.

`--strategy ddp` has no pipeckpt in it: a failure then points at the cluster, the job script or
Lightning, not at the pipeline. `--strategy pipe` runs the distributed engine, one stage per process.
Devices and nodes come from SLURM when it is there, else two processes on this machine:

    srun -J job -N2 --ntasks-per-node=1 python tests/slurm/job.py OUT_DIR --strategy ddp
    python tests/slurm/job.py OUT_DIR --strategy pipe

The test-only fault hooks of faults.py are always installed; environment variables switch them on.
"""

from __future__ import annotations

import argparse
import os

import torch
from faults import FaultInjection
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def configure_pipeline(self) -> nn.Sequential:
        return self.net

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)


def strategy(name: str):
    if name == "ddp":
        return "ddp"
    from pipeckpt import PipelineStrategy

    return PipelineStrategy(engine="distributed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--strategy", choices=["ddp", "pipe"], default="ddp")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu",
        strategy=strategy(args.strategy),
        devices=int(os.environ.get("SLURM_NTASKS_PER_NODE", 2)),
        num_nodes=int(os.environ.get("SLURM_NNODES", 1)),
        max_steps=args.steps,
        log_every_n_steps=1,
        default_root_dir=args.out_dir,
        logger=CSVLogger(args.out_dir, name="csv", version=0),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.out_dir, "checkpoints")), FaultInjection()],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), data())


if __name__ == "__main__":
    main()
