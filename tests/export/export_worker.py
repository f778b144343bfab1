"""One process of a test run of tests/export/test_export_distributed.py (the pattern of
tests/engines/distributed/distributed_hf_calls_worker.py).

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/export/export_worker.py SPEC.json

Each run trains ``model`` ("gpt2" or "llama" of tests/support/hf_models.py, or "lora": PEFT LoRA on
the Llama) for ``steps`` steps under engine="distributed" with ``HFExport`` writing `<name>-hf` into
the spec's `out` directory when training ends, then saves the sharded checkpoint `<name>.ckpt`. A
run with ``fails`` must raise from ``fit``: each rank writes what it raised to `<name>.rank<R>.error`;
there global rank 0 puts a file of the user's into `<name>-hf` when training ends, after HFExport
checked it at fit start, so that only rank 0's export is refused.
A run with ``path`` fine-tunes the Llama of that pretrained directory instead (built on the meta
device, filled by ``pipeckpt.pretrained``) and each rank saves the whole values of the weights it
holds after training (a DTensor gathered with ``full_tensor``) to `<name>.trained<R>.pt`. A run's
``dtype`` is HFExport's. Under
``checkpoint='auto'`` rank 0 writes the tensor-parallel plan the choice counted to `<name>.counted.json`.
"""

import json
import os
from pathlib import Path
from typing import Any, Dict

import torch
from lightning.pytorch import Callback
from support.frozen_models import LoraLlama
from support.hf_models import HFModule, batches, whole
from support.pretrained_models import FromPretrained
from support.ranks import quiet_trainer, serve
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from pipeckpt import PipelineStrategy
from pipeckpt.export import HFExport


class UsersFileAtTheEnd(Callback):
    """On global rank 0, writes a file of the user's into ``directory`` when training ends."""

    def __init__(self, directory: "os.PathLike[str]") -> None:
        self.directory = Path(directory)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:
            self.directory.mkdir()
            (self.directory / "notes.txt").write_text("mine")


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module: Any
    if "path" in spec:
        module = FromPretrained("llama", Path(spec["path"]), build="meta")
    else:
        module = LoraLlama() if spec["model"] == "lora" else HFModule(spec["model"], whole)
    export = HFExport(
        os.path.join(out, f"{spec['name']}-hf"),
        max_shard_size=spec["max_shard_size"],
        dtype=spec.get("dtype"),
    )
    spoil = [UsersFileAtTheEnd(export.dirpath)] if spec.get("fails") else []  # runs before HFExport's hook
    trainer = quiet_trainer(strategy, world, max_steps=spec["steps"], callbacks=[*spoil, export])
    data = DataLoader(batches(spec["steps"]), batch_size=None)
    if spec.get("fails"):
        try:
            trainer.fit(module, data)
        except Exception as error:
            rank = os.environ["LOCAL_RANK"]
            Path(out, f"{spec['name']}.rank{rank}.error").write_text(f"{type(error).__name__}: {error}")
            return
        raise AssertionError(f"{spec['name']}: fit did not fail")
    trainer.fit(module, data)
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    if "path" in spec:
        held = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.model.state_dict().items()
            if isinstance(v, DTensor) or not v.is_meta
        }
        torch.save(held, Path(out, f"{spec['name']}.trained{trainer.global_rank}.pt"))
    if strategy.auto_plan is not None and trainer.is_global_zero:  # checkpoint='auto': the plan it counted
        layout = strategy.auto_plan.layout
        counted = dict(layout.tp_plan) if layout else None
        Path(out, f"{spec['name']}.counted.json").write_text(json.dumps(counted))


if __name__ == "__main__":
    serve(run)
