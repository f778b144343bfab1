"""Your own LightningModule, pipelined: no Hydra, no pipeckpt models.

The only addition to ordinary Lightning code is ``configure_pipeline``, which
returns the ``nn.Sequential`` to cut into stages. Here a small regression
network is cut into 3 stages of 4 micro-batches, each stage with its own
checkpoint mode, and StageReport prints what each stage cost.

    python examples/custom_module.py
"""

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pipeckpt
from pipeckpt.report.stage_report import StageReport


class Residual(nn.Module):
    """``x + mlp(norm(x))``: one tensor in, one tensor out, as every pipeline layer must be."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Regressor(L.LightningModule):
    def __init__(self, features: int = 16, width: int = 128, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(features, width), *(Residual(width) for _ in range(depth)), nn.Linear(width, 1)
        )

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.layers(x)  # runs through the pipeline's stages
        loss = F.mse_loss(prediction, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def dataset(features: int = 16, samples: int = 2048) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=g)
    return TensorDataset(x, torch.sin(x @ torch.randn(features, 1, generator=g) / features**0.5))


@torch.no_grad()
def mse(model: Regressor, data: TensorDataset) -> float:
    x, y = data.tensors
    return F.mse_loss(model.layers(x), y).item()  # outside fit, layers is a plain Sequential


if __name__ == "__main__":
    torch.set_num_threads(1)  # one OpenMP team per pipeline thread is enough on a small CPU
    L.seed_everything(0)
    strategy = pipeckpt.PipelineStrategy(
        stages=3,  # on CPU all stages share the CPU; on a GPU host, one GPU each
        chunks=4,  # micro-batches per batch of 64
        checkpoint=["always", "except_last", "never"],  # early stages hold activations longest
    )
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=60,
        logger=False,
        enable_checkpointing=False,
        callbacks=[StageReport(dirpath="outputs/custom_module")],
    )
    model, data = Regressor(), dataset()
    before = mse(model, data)
    trainer.fit(model, DataLoader(data, batch_size=64, shuffle=True, drop_last=True))
    print(f"mean squared error: {before:.4f} before training, {mse(model, data):.4f} after")
