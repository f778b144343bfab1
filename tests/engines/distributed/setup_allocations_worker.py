"""One rank of a set-up allocation run, started by test_setup_allocations.py beside it (see
tests/support/ranks.py).

A Sequential of Linear layers built in ``configure_model`` trains one step as pp2. From before
``trainer.fit`` to train start, every storage a torch operator creates is noted (its bytes, the
operator, and a weak reference, so nothing is kept alive by the noting); at train start the rank
saves to ``rank<r>.pt`` those storages, each marked held or not (a parameter or buffer of the module
holds it), and the bytes of the parameters it holds."""

import weakref
from pathlib import Path
from typing import Any, Dict, List

import lightning as L
import torch
from support.ranks import quiet_trainer, serve
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy
from pipeckpt._compat import TorchDispatchMode, tree_flatten

WIDTH, LAYERS = 256, 6


class Created(TorchDispatchMode):
    """Every storage an operator creates while it is on: (bytes, operator, weak reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: Dict[int, Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and not t.is_meta:
                st = t.untyped_storage()
                if st.nbytes() and id(st) not in self.storages:
                    self.storages[id(st)] = (st.nbytes(), str(func), weakref.ref(st))
        return out


class Linears(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers  # type: ignore[return-value]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.layers(batch[0]).pow(2).mean()  # type: ignore[misc]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AtTrainStart(L.Callback):
    def __init__(self, created: Created) -> None:
        self.created = created
        self.result: Dict[str, Any] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.created.__exit__(None, None, None)
        real = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
        held = {id(t.untyped_storage()) for t in real}
        rows: List[Dict[str, Any]] = []
        for key, (nbytes, op, ref) in self.created.storages.items():
            rows.append(dict(bytes=nbytes, op=op, held=ref() is not None and key in held))
        self.result = dict(created=rows, held_bytes=sum(t.numel() * t.element_size() for t in real))


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    L.seed_everything(3)
    created = Created()
    probe = AtTrainStart(created)
    strategy = PipelineStrategy(engine="distributed", balance=spec["balance"], chunks=2)
    trainer = quiet_trainer(strategy, world, max_steps=1, callbacks=[probe])
    data = DataLoader(TensorDataset(torch.randn(4, WIDTH)), batch_size=4)
    created.__enter__()
    trainer.fit(Linears(), data)
    torch.save(probe.result, Path(out) / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    serve(run)
