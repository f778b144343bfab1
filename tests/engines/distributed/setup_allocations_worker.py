"""One rank of a set-up memory run, started by test_setup_allocations.py beside it (see
tests/support/ranks.py).

``linears``: a Sequential of Linear layers built in ``configure_model`` trains one step as pp2. From
before ``trainer.fit`` to train start, every storage a torch operator creates is noted (its bytes,
the operator, and a weak reference, so nothing is kept alive by the noting); at train start the rank
saves to ``linears_rank<r>.pt`` those storages, each marked held or not (a parameter or buffer of
the module holds it). ``pretrained``: a Llama built on meta and filled from the spec's directory
(``pipeckpt.pretrained``, ``pipeline_of``) as pp2; the peak resident memory is reset just before
``trainer.fit``, and at train start the rank saves its peak and current resident bytes."""

import weakref
from pathlib import Path
from typing import Any, Dict, List, Tuple

import lightning as L
import torch
import transformers
from support.ranks import quiet_trainer, serve
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import pipeckpt
from pipeckpt import PipelineStrategy
from pipeckpt._compat import TorchDispatchMode, tree_flatten

WIDTH, LAYERS = 256, 6


class Created(TorchDispatchMode):
    """Every storage an operator creates while it is on: (bytes, operator, weak reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: List[Tuple[int, str, Any]] = []
        self._alive: Dict[int, Any] = {}  # data pointer -> the storage noted there, while it lives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and not t.is_meta and t.untyped_storage().nbytes():
                st = t.untyped_storage()
                noted = self._alive.get(st.data_ptr())
                if noted is None or noted() is None:  # not a view of a storage noted already
                    self._alive[st.data_ptr()] = ref = weakref.ref(st)
                    self.storages.append((st.nbytes(), str(func), ref))
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
        held = {t.untyped_storage().data_ptr() for t in real}
        rows: List[Dict[str, Any]] = []
        for nbytes, op, ref in self.created.storages:
            st = ref()
            rows.append(dict(bytes=nbytes, op=op, held=st is not None and st.data_ptr() in held))
        self.result = dict(created=rows, held_bytes=sum(t.numel() * t.element_size() for t in real))


def _resident() -> Dict[str, int]:
    """This process's peak and current resident bytes."""
    with open("/proc/self/status") as f:
        return {
            k: int(v.split()[0]) * 1024
            for k, v in (line.split(":", 1) for line in f)
            if k in ("VmHWM", "VmRSS")
        }


class Llama(L.LightningModule):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.model = path, None

    def configure_model(self) -> None:
        if self.model is None:
            config = transformers.AutoConfig.from_pretrained(self.path)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            self.model = pipeckpt.pretrained(model, self.path)

    def configure_pipeline(self) -> nn.Module:
        return pipeckpt.pipeline_of(self.model, "model.layers")

    def training_step(self, batch: Dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss  # type: ignore[misc]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Resident(L.Callback):
    def __init__(self) -> None:
        self.result: Dict[str, Any] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.result = _resident()


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    L.seed_everything(3)
    if spec["case"] == "pretrained":
        resident = Resident()
        strategy = PipelineStrategy(engine="distributed", stages=world, chunks=2)
        trainer = quiet_trainer(strategy, world, max_steps=1, callbacks=[resident])
        ids = torch.randint(0, 64, (2, 8))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident memory starts again from here
        trainer.fit(Llama(spec["path"]), DataLoader([{"input_ids": ids, "labels": ids}], batch_size=None))
        torch.save(resident.result, Path(out) / f"pretrained_rank{trainer.global_rank}.pt")
        return
    created = Created()
    probe = AtTrainStart(created)
    strategy = PipelineStrategy(engine="distributed", balance=spec["balance"], chunks=2)
    trainer = quiet_trainer(strategy, world, max_steps=1, callbacks=[probe])
    data = DataLoader(TensorDataset(torch.randn(4, WIDTH)), batch_size=4)
    created.__enter__()
    trainer.fit(Linears(), data)
    torch.save(probe.result, Path(out) / f"linears_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    serve(run)
