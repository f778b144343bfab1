"""One process of tests/engines/distributed/test_distributed_rooted_dp.py: ``pipeline_of`` under the
distributed engine with
data-parallel replicas (4 processes: 2 pipeline stages x 2 replicas).

    python tests/engines/distributed/distributed_rooted_dp_worker.py SPEC.json

Each run of the spec trains ``client`` ("gpt2" or "demo", tests/support/real_models.py), replica r reading
samples r, r + dp, ... of its data in order, writes ``<name>.ckpt`` and, per rank,
``<name>.rank<R>.pt``: the tensors that rank holds and their last step's gradients. With ``skew``, the
ranks of replica 1 and up start from other weights than replica 0's (a model drawn on another seed),
so that only a broadcast from replica 0 makes the replicas train alike.
"""

import os
from typing import Any, Dict

import torch
from support.ranks import quiet_trainer, serve
from support.real_models import client
from torch.utils.data import DataLoader, Subset

from pipeckpt import PipelineStrategy


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module, loader = client(spec["client"])
    rank, dp = int(os.environ["LOCAL_RANK"]), spec["strategy"]["dp"]
    replica = rank // (world // dp)
    # Replica r reads samples r, r + dp, ... (Lightning's distributed sampler would shuffle them).
    mine = Subset(loader.dataset, range(replica, len(loader.dataset), dp))  # type: ignore[arg-type]
    loader = DataLoader(mine, batch_size=loader.batch_size)
    if spec.get("skew") and replica > 0:
        torch.manual_seed(1000 + rank)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p))
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=spec["steps"],
        gradient_clip_val=spec.get("gradient_clip_val"),
    )
    torch.manual_seed(123)
    trainer.fit(module, loader)
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    held = {k: v.detach().clone() for k, v in module.state_dict().items() if not v.is_meta}
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    torch.save(
        {"held": held, "grads": grads}, os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.pt")
    )


if __name__ == "__main__":
    serve(run)
