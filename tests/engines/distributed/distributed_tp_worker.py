"""One process of tests/engines/distributed/test_distributed_tp.py (the pattern of
distributed_fsdp_worker.py).

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/engines/distributed/distributed_tp_worker.py SPEC.json

Each run trains :class:`TinyLlama` under engine="distributed" on this replica's rows of every
batch (from ``resume``, a checkpoint of an earlier run, if given; saving every ``checkpoint_every``
steps if given), and writes the sharded checkpoint `<name>.ckpt` and `<name>.rank<R>.pt`: the mesh the module
saw in ``configure_model`` and, per parameter this rank holds, its local and whole sizes, and for a
DTensor its mesh's dimensions, its placements and the global ranks of its group on each dimension.
"""

import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from support.ranks import quiet_trainer, serve
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from pipeckpt import PipelineStrategy
from pipeckpt.app.models.llama import Llama

BATCH, LENGTH, BATCHES, TOKENS = 8, 16, 3, 64

#: Megatron's split of a Llama decoder layer: q, k, v and the MLP's gate and up by output features,
#: the attention's and the MLP's output projections by input features (one all-reduce each).
PLAN = {
    "layer.self_attn.[qkv]_proj": "colwise",
    "layer.self_attn.o_proj": "rowwise",
    "layer.mlp.gate_proj": "colwise",
    "layer.mlp.up_proj": "colwise",
    "layer.mlp.down_proj": "rowwise",
}


class TinyLlama(Llama):
    """Llama ``tiny`` (2 decoder layers, 4 heads, 2 KV heads) that notes, in ``configure_model``, the
    mesh it was handed; AdamW's ``eps`` near the gradients' size, so that the step depends on their
    scale and a clipping norm counted wrong shows in the weights."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(size="tiny", seq_len=LENGTH, vocab_size=TOKENS)
        self.mesh_seen: Dict[str, int] = {}

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            mesh = self.device_mesh
            self.mesh_seen = dict(zip(mesh.mesh_dim_names or (), mesh.shape))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)


def batches() -> List[Tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, TOKENS, (BATCH, LENGTH), generator=g),
            torch.randint(0, TOKENS, (BATCH, LENGTH), generator=g),
        )
        for _ in range(BATCHES)
    ]


def replica_rows(data: List[Tuple[Tensor, Tensor]], replica: int, dp: int) -> List[Tuple[Tensor, Tensor]]:
    share = BATCH // dp
    return [
        (x[replica * share : (replica + 1) * share], y[replica * share : (replica + 1) * share])
        for x, y in data
    ]


def loader(data: List[Any]) -> DataLoader:
    return DataLoader(data, batch_size=None, shuffle=False)


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    settings = spec["strategy"]
    strategy = PipelineStrategy(engine="distributed", **settings)
    module = TinyLlama()
    dp = settings["dp"]
    replica = int(os.environ["LOCAL_RANK"]) // (world // dp)  # the mesh's outermost dimension
    every = spec.get("checkpoint_every")
    saves = [
        ModelCheckpoint(dirpath=os.path.join(out, spec["name"]), every_n_train_steps=every, save_top_k=-1)
    ]
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=spec["steps"],
        gradient_clip_val=spec.get("clip"),
        enable_checkpointing=every is not None,
        callbacks=saves if every else [],
    )
    torch.manual_seed(123)
    resume = spec.get("resume")
    trainer.fit(
        module, loader(replica_rows(batches(), replica, dp)), ckpt_path=resume and os.path.join(out, resume)
    )
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    held: Dict[str, Any] = {
        "mesh": module.mesh_seen,
        "params": {n: _sizes(p) for n, p in module.named_parameters() if not p.is_meta},
    }
    if strategy.auto_plan is not None:  # checkpoint="auto": the modes rank 0 chose and this rank built
        assert strategy.plan is not None
        held["chosen"] = [m.name for m in strategy.auto_plan.choice.modes]
        held["built"] = [m.name for m in strategy.plan.modes]
    torch.save(held, os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.pt"))


def _sizes(t: Tensor) -> Dict[str, Any]:
    if not isinstance(t, DTensor):
        return {"local": t.numel(), "whole": t.numel(), "mesh": []}
    mesh = t.device_mesh
    return {
        "local": t.to_local().numel(),
        "whole": t.numel(),
        "mesh": list(mesh.mesh_dim_names or ()),
        "placements": [repr(p) for p in t.placements],
        "groups": [dist.get_process_group_ranks(mesh.get_group(i)) for i in range(mesh.ndim)],
    }


if __name__ == "__main__":
    serve(run)
