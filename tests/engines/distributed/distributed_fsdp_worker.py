"""One process of a test run of tests/engines/distributed/test_distributed_fsdp.py (the pattern of
distributed_real_models_worker.py).

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/engines/distributed/distributed_fsdp_worker.py SPEC.json

Each run trains ``model`` (:func:`build`) under engine="distributed" on this replica's rows of every
batch, from ``resume`` if given (a path relative to `out`, or absolute), and writes the sharded
checkpoint `<name>.ckpt` and `<name>.rank<R>.pt` (the types and local sizes of the tensors this rank
holds) into `out`; with ``checkpoint_every``, also Lightning's ModelCheckpoint every so many steps
into `out/<name>/` (a checkpoint written in the epoch's last step resumes exactly at the next epoch).
"""

import os
from typing import Any, Dict, List, Tuple

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support import hf_models
from support.ranks import quiet_trainer, serve
from support.toy import ToyModule
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from pipeckpt import PipelineStrategy

BATCH, LENGTH, BATCHES = 8, 12, 3


def batches() -> List[Dict[str, Tensor]]:
    """Unpadded token batches: every micro-batch of every replica holds as many label tokens, so the
    replicas' mean of per-replica mean losses is the joined batch's mean loss."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(BATCHES):
        ids = torch.randint(1, hf_models.VOCAB, (BATCH, LENGTH), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def toy_batches() -> List[Tuple[Tensor, Tensor]]:
    """Two batches: an epoch ends at step 2, where the resume test saves (a resume restarts the
    epoch's batches)."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(2)
    ]


class _AdamW:
    def configure_optimizers(self) -> Any:
        # eps well above rounding noise: a gradient that is zero in exact arithmetic (GPT-2's key
        # bias) is noise of ~1e-10, which AdamW's default eps would turn into full-size steps that
        # differ with every summation order.
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-4)  # type: ignore[attr-defined]


class HF(_AdamW, hf_models.HFModule):
    pass


class Toy(_AdamW, ToyModule):
    pass


def build(model: str) -> Tuple[L.LightningModule, List[Any]]:
    """The module ``model`` names ('toy', or an HF model of support.hf_models) and its batches."""
    if model == "toy":
        return Toy(), toy_batches()
    return HF(model, hf_models.whole), batches()


def replica_rows(data: List[Any], replica: int, dp: int) -> List[Any]:
    """Replica ``replica``'s contiguous share of every batch."""
    share = BATCH // dp
    rows = slice(replica * share, (replica + 1) * share)
    return [
        {k: v[rows] for k, v in b.items()} if isinstance(b, dict) else tuple(t[rows] for t in b) for b in data
    ]


def loader(data: List[Any]) -> DataLoader:
    return DataLoader(data, batch_size=None, shuffle=False)


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    settings = spec["strategy"]
    strategy = PipelineStrategy(engine="distributed", **settings)
    module, data = build(spec["model"])
    dp = settings.get("dp", 1)
    replica = int(os.environ["LOCAL_RANK"]) // (world // dp)
    every = spec.get("checkpoint_every")
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=spec["steps"],
        precision=spec.get("precision", "32-true"),
        gradient_clip_val=spec.get("gradient_clip_val"),
        enable_checkpointing=every is not None,
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(out, spec["name"]), every_n_train_steps=every, save_top_k=-1)
        ]
        if every
        else [],
    )
    torch.manual_seed(123)
    resume = spec.get("resume")
    trainer.fit(
        module, loader(replica_rows(data, replica, dp)), ckpt_path=resume and os.path.join(out, resume)
    )
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    optimizer = trainer.optimizers[0]
    held = {
        "params": {n: _local(p) for n, p in module.named_parameters() if not p.is_meta},
        "state": [_local(t) for s in optimizer.state.values() for t in s.values() if t.dim() > 0],
    }
    torch.save(held, os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.pt"))


def _local(t: Tensor) -> Dict[str, Any]:
    return {
        "sharded": isinstance(t, DTensor),
        "numel": (t.to_local() if isinstance(t, DTensor) else t).numel(),
    }


if __name__ == "__main__":
    serve(run)
