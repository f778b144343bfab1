"""One process of a distributed-engine test run, started by
tests/engines/distributed/test_distributed_engine.py.

The test starts every rank itself with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set,
as torchrun or srun would, so Lightning launches nothing. A JSON spec lists trainings to run one
after the other in the same processes (a process start costs seconds on a small machine):

    python tests/engines/distributed/distributed_worker.py SPEC.json

Each run trains the toy module of toy.py and writes `<name>.ckpt` (global rank 0, the gathered
checkpoint) and `<name>.rank<R>.json` (what that rank saw) into the spec's `out` directory.
"""

import json
import os
import signal
import time
from typing import Any, Dict, List

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from support.ranks import quiet_trainer, serve
from support.toy import ToyModule, toy_loader
from torch.utils.data import DataLoader, TensorDataset

from pipeckpt import PipelineStrategy
from pipeckpt.report.stage_report import StageReport


def replica_loader(dp: int, replica: int) -> DataLoader:
    """This replica's share of every batch of toy_loader(): contiguous rows of each batch."""
    x, y = toy_loader().dataset.tensors
    batch, share = 16, 16 // dp
    rows = torch.cat(
        [torch.arange(b, b + batch)[replica * share : (replica + 1) * share] for b in range(0, len(x), batch)]
    )
    return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=share, shuffle=False)


def gloo_groups() -> int:
    """The gloo process groups open in this process: each runs one thread named ``gloo_tcp_loop``."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names.count("gloo_tcp_loop")


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
    """`resume_run`: the checkpoint an earlier run of the same spec wrote (`resume_from`: a path
    relative to `out`, e.g. one of its ModelCheckpoint files)."""
    if "resume_from" in spec:
        return os.path.join(out, spec["resume_from"])
    return os.path.join(out, f"{spec['resume_run']}.ckpt") if "resume_run" in spec else None


class BatchNormProbe(L.Callback):
    """This rank's BatchNorm running means when training starts (after set-up) and when the first real
    micro-batch reaches each one (after the schedule's shape inference, which must leave them alone)."""

    def __init__(self) -> None:
        self.at_start: Dict[str, Any] = {}
        self.at_first: Dict[str, Any] = {}
        self.stage_modules: List[Any] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.stage_modules = trainer.strategy.engine.modules  # live while a real micro-batch runs
        for name, m in module.named_modules():
            if isinstance(m, torch.nn.BatchNorm1d) and not m.running_mean.is_meta:
                self.at_start[name] = m.running_mean.tolist()
                m.register_forward_pre_hook(self._first(name))

    def _first(self, name: str) -> Any:
        def hook(m: torch.nn.Module, _: Any) -> None:
            if name not in self.at_first and any(s.live for s in self.stage_modules):
                self.at_first[name] = m.running_mean.tolist()

        return hook


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    # `start_late`: {rank: seconds} this rank sleeps before it starts (a slow node, slow imports)
    time.sleep(spec.get("start_late", {}).get(os.environ["LOCAL_RANK"], 0))
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module = ToyModule(
        depth=spec.get("depth", 6), dropout=spec.get("dropout", 0.0), batch_norm=spec.get("batch_norm", False)
    )
    probe = BatchNormProbe()
    callbacks: List[L.Callback] = [probe]
    if "checkpoint_every" in spec:
        every = spec["checkpoint_every"]
        callbacks.append(
            ModelCheckpoint(dirpath=os.path.join(out, spec["name"]), every_n_train_steps=every, save_top_k=-1)
        )
    if spec.get("report"):
        report_dir = os.path.join(out, spec["name"])
        callbacks.append(StageReport(warmup_steps=1, steps=1, dirpath=report_dir, verbose=False))
    if "die" in spec:
        die_mid_step(module, **spec["die"])
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=spec["steps"],
        # `checkpoint_every`: ModelCheckpoint every so many steps into <out>/<name>/ (sharded directories)
        enable_checkpointing="checkpoint_every" in spec,
        callbacks=callbacks,
        limit_val_batches=1.0 if spec.get("validate") else 0,
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
        "batch_norm_at_start": probe.at_start,
        "batch_norm_at_first_microbatch": probe.at_first,
        # the process groups the engine opened: its mesh's dimensions, and whether the pipeline
        # talks in the default group
        "mesh": list(trainer.strategy.engine.processes.mesh.mesh_dim_names),
        "pipeline_in_default_group": trainer.strategy.engine.processes.pp_group.group_name
        == dist.group.WORLD.group_name,
        "gloo_groups": gloo_groups(),
    }
    if spec.get("validate"):
        trainer.validate(
            module, replica_loader(dp, trainer.strategy.distributed_sampler_kwargs["rank"]), verbose=False
        )
        seen["metrics"].update({k: float(v) for k, v in trainer.callback_metrics.items()})
    with open(os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    serve(run)
