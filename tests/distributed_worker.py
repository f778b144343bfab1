"""One process of a distributed-engine test run, started by tests/test_distributed_engine.py.

The test starts every rank itself with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set,
as torchrun or srun would, so Lightning launches nothing. A JSON spec lists trainings to run one
after the other in the same processes (a process start costs seconds on a small machine):

    python tests/distributed_worker.py SPEC.json

Each run trains the toy module of toy.py and writes `<name>.ckpt` (global rank 0, the gathered
checkpoint) and `<name>.rank<R>.json` (what that rank saw) into the spec's `out` directory.
"""

import json
import os
import signal
import sys
import time
from typing import Any, Dict

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from toy import ToyModule, toy_loader

from pipeckpt import PipelineStrategy
from pipeckpt.report import StageReport


def replica_loader(dp: int, replica: int) -> DataLoader:
    """This replica's share of every batch of toy_loader(): contiguous rows of each batch."""
    x, y = toy_loader().dataset.tensors
    batch, share = 16, 16 // dp
    rows = torch.cat(
        [torch.arange(b, b + batch)[replica * share : (replica + 1) * share] for b in range(0, len(x), batch)]
    )
    return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=share, shuffle=False)


def die_mid_step(
    module: L.LightningModule, step: int, microbatch: int, hang: bool = False, raises: bool = False
) -> None:
    """The rank holding the last layer kills itself (or hangs, or raises) in that layer's forward
    of one micro-batch."""
    calls = {"n": 0}

    def hook(*_: Any) -> None:
        if module.trainer.global_step != step or not torch.is_grad_enabled():
            return
        calls["n"] += 1
        if calls["n"] == microbatch + 1:
            what = "hangs" if hang else "raises" if raises else "dies"
            print(f"worker: rank {module.trainer.global_rank} {what} at time={time.time():.3f}", flush=True)
            if hang:
                time.sleep(3600)
            if raises:
                raise ValueError(f"the last layer refuses micro-batch {microbatch} of step {step}")
            os.kill(os.getpid(), signal.SIGKILL)

    module.layers[-1].register_forward_hook(hook)


def resume_run(spec: Dict[str, Any], out: str) -> Any:
    """`resume_run`: the checkpoint an earlier run of the same spec wrote."""
    return os.path.join(out, f"{spec['resume_run']}.ckpt") if "resume_run" in spec else None


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module = ToyModule(depth=spec.get("depth", 6), dropout=spec.get("dropout", 0.0))
    if "die" in spec:
        die_mid_step(module, **spec["die"])
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=spec["steps"],
        logger=False,
        # `checkpoint_every`: ModelCheckpoint every so many steps into <out>/<name>/ (sharded directories)
        enable_checkpointing="checkpoint_every" in spec,
        callbacks=[
            ModelCheckpoint(
                dirpath=os.path.join(out, spec["name"]),
                every_n_train_steps=spec["checkpoint_every"],
                save_top_k=-1,
            )
        ]
        if "checkpoint_every" in spec
        else []
        + (
            [StageReport(warmup_steps=1, steps=1, dirpath=os.path.join(out, spec["name"]), verbose=False)]
            if spec.get("report")
            else []
        ),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if spec.get("validate") else 0,
        use_distributed_sampler=False,
        accumulate_grad_batches=spec.get("accumulate_grad_batches", 1),
        gradient_clip_val=spec.get("gradient_clip_val"),
    )
    torch.manual_seed(123)
    dp = trainer.strategy.distributed_sampler_kwargs["num_replicas"]
    trainer.fit(
        module,
        replica_loader(dp, trainer.strategy.distributed_sampler_kwargs["rank"]),
        ckpt_path=spec.get("resume") or resume_run(spec, out),
    )
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    seen = {
        "forward_calls": {s.index: s.forward_calls for s in trainer.strategy.stages},
        "checkpointed": {s.index: s.checkpointed for s in trainer.strategy.stages},  # the last step's
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    if spec.get("validate"):
        trainer.validate(
            module, replica_loader(dp, trainer.strategy.distributed_sampler_kwargs["rank"]), verbose=False
        )
        seen["metrics"].update({k: float(v) for k, v in trainer.callback_metrics.items()})
    with open(os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(seen, f)


def main() -> None:
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])  # Lightning's teardown deletes it after a run
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for one in spec["runs"]:
        run(one, spec["out"], world)


if __name__ == "__main__":
    main()
