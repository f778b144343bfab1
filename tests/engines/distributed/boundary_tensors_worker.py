"""One process of a test run of tests/engines/distributed/test_boundary_tensors.py (the pattern of
distributed_pytree_worker.py).

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/engines/distributed/boundary_tensors_worker.py SPEC.json

Each run trains ``model`` ("odd": :class:`OddTensors`, whose first stage returns every kind of tensor;
or a Hugging Face model of tests/support/hf_zoo.py, e.g. "t5") under engine="distributed" and writes
`<name>.ckpt` into the spec's `out` directory.
"""

import os
from typing import Any, Dict

import lightning as L
import torch
import torch.nn.functional as F
from support.hf_zoo import hf_data, hf_module
from support.ranks import quiet_trainer, serve
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy


class Spread(nn.Module):
    """Returns one tensor of each kind that crosses a process boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: Tensor) -> Dict[str, Tensor]:
        y = self.lin(x)
        b = y.size(0)
        return {
            "view": y.view(b, 2, 3).transpose(1, 2),  # a non-contiguous view
            "slice": y[:, ::2],  # strided
            "image": y.view(b, 6, 1, 1).expand(b, 6, 2, 2).contiguous(memory_format=torch.channels_last),
            "scalar": self.lin.bias.sum(),  # 0-dim, needs a gradient
            "count": torch.tensor(6),  # 0-dim integer
            "mask": y > 0,  # bool
            "index": y.argmax(1),  # int64
            "frozen": x.t().t() * 2,  # floating, no gradient
        }


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 1)

    def forward(self, d: Dict[str, Tensor]) -> Tensor:
        z = d["view"].transpose(1, 2).reshape(-1, 6) + d["image"].mean((2, 3)) + d["mask"].float()
        z = z + d["slice"].repeat(1, 2) * d["index"].float().unsqueeze(1) + d["frozen"].sum(1, keepdim=True)
        return self.lin(z + d["scalar"] / d["count"])


class OddTensors(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(Spread(), Join())

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def odd_data(samples: int = 16, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(samples, 4, generator=g), torch.randn(samples, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def module_and_data(model: str, samples: int = 16) -> Any:
    if model == "odd":
        return OddTensors(), odd_data(samples)
    return hf_module(model, dropout=0.0), hf_data(samples)


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module, loader = module_and_data(spec["model"], spec.get("samples", 16))
    trainer = quiet_trainer(strategy, world, max_steps=spec["steps"])
    torch.manual_seed(123)
    trainer.fit(module, loader)
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))


if __name__ == "__main__":
    serve(run)
