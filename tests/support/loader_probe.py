"""A callback that writes down, in the process it runs in, what the training loader is once Lightning
has prepared it and which rows each step trains on: ``train.py`` takes it as one more callback
(``+callbacks.loader_probe._target_=support.loader_probe.LoaderProbe``), so a test reads what every
rank of a real run saw (tests/app/test_dataset_resume.py)."""

import hashlib
import json
from pathlib import Path
from typing import Any, Dict

from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["LoaderProbe", "read_probes"]


class LoaderProbe(Callback):
    """Appends to ``<dirpath>/probe-rank<global rank>.jsonl``: at the start of training the loader's and
    its sampler's classes, the sampler's replica settings and the loader's state; then, for each
    batch, the global step it trains and a digest of its ``input_ids``."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def _write(self, trainer: Trainer, record: Dict[str, Any]) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        with open(self.dirpath / f"probe-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        state = loader.state_dict() if hasattr(loader, "state_dict") else None
        self._write(
            trainer,
            {
                "loader": type(loader).__name__,
                "sampler": type(sampler).__name__,
                "num_replicas": getattr(sampler, "num_replicas", None),
                "rank": getattr(sampler, "rank", None),
                "state": state,
            },
        )

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        ids = batch["input_ids"].cpu().numpy().tobytes()
        self._write(trainer, {"step": trainer.global_step, "batch": hashlib.sha256(ids).hexdigest()[:16]})


def read_probes(dirpath: Path, rank: int) -> list:
    """The records rank ``rank`` wrote under ``dirpath``, in order."""
    return [json.loads(line) for line in (dirpath / f"probe-rank{rank}.jsonl").read_text().splitlines()]
