"""One process of a sharded-checkpoint test, started by tests/state/test_sharded.py (and the model it uses).

    python tests/state/sharded_worker.py pipeline OUT     # RANK, WORLD_SIZE, MASTER_ADDR/PORT set
    python tests/state/sharded_worker.py overwrite OUT    # one process, no group: saves until killed

`pipeline`: ranks hold the stages of a two-stage pipeline (stage = rank % 2; with 4 ranks, two
replicas), the other stage's layers on `meta` as in the distributed engine. Each rank trains its own
layers (every layer has its own loss, so the result equals training the whole model in one process),
saves twice to OUT/ckpt (the second replaces the first), tries a third save that fails on rank 1 in the
middle of writing, then loads its own keys alone. What each rank saw goes to OUT/rank<R>.json and
OUT/loaded<R>.pt.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from pipeckpt.state import sharded

STAGES: Tuple[Tuple[int, ...], ...] = ((0, 1), (2, 3))  # layer indices of each stage


def _layer(index: int, device: str) -> nn.Module:
    torch.manual_seed(100 + index)  # a layer's values do not depend on which others exist
    return [
        lambda: nn.Linear(8, 16, device=device),
        lambda: nn.BatchNorm1d(16, device=device),
        lambda: nn.Linear(16, 16, device=device),
        lambda: nn.Linear(16, 4, device=device),
    ][index]()


def build(own: Tuple[int, ...] = (0, 1, 2, 3)) -> Tuple[nn.Sequential, torch.optim.Adam]:
    """The model with the layers in `own` on the CPU and the others on `meta`, and Adam over all of
    it: two param groups, and one frozen parameter that never gets state."""
    model = nn.Sequential(*[_layer(i, "cpu" if i in own else "meta") for i in range(4)])
    model[2].bias.requires_grad_(False)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return model, torch.optim.Adam([{"params": weights}, {"params": others, "lr": 0.01}], lr=0.05)


def names(model: nn.Module) -> List[str]:
    """The names of the optimizer's parameters of build(), in its order."""
    params = dict(model.named_parameters())
    return [n for n in params if n.endswith("weight")] + [n for n in params if not n.endswith("weight")]


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, own: Tuple[int, ...], *, first: int = 0
) -> None:
    """Steps `first`, `first + 1`, ... (each step's data depends on its number)."""
    width = {0: 8, 1: 16, 2: 16, 3: 16}
    for step in range(first, first + steps):
        optimizer.zero_grad()
        for i in own:
            x = torch.randn(6, width[i], generator=torch.Generator().manual_seed(1000 * step + i))
            model[i](x).pow(2).mean().backward()
        optimizer.step()


def own_keys(model: nn.Module, own: Tuple[int, ...]) -> List[str]:
    return [k for k in model.state_dict() if int(k.split(".")[0]) in own]


def checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, own: Tuple[int, ...], tag: int) -> Dict:
    """What the engine hands to sharded.save on this rank: its own tensors, state keyed by name."""
    keys = set(own_keys(model, own))
    by_name = sharded.optimizer_state_by_name(optimizer.state_dict(), names(model))
    by_name["state"] = {n: s for n, s in by_name["state"].items() if n in keys}
    return {
        "epoch": tag,
        "global_step": 7,
        "loops": {"fit_loop": {"nested": [1, 2]}},
        "state_dict": {k: v for k, v in model.state_dict().items() if k in keys},
        "optimizer_states": [by_name],
    }


class Unpicklable:
    """Breaks DCP's write of the rank that holds it, after the others have started writing."""

    def __reduce__(self) -> Any:
        raise RuntimeError("injected failure while writing")


def pipeline(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    own = STAGES[rank % 2]
    model, optimizer = build(own)
    seen: Dict[str, Any] = {"own_keys": own_keys(model, own)}
    train(model, optimizer, 2, own)
    sharded.save(checkpoint(model, optimizer, own, tag=10 + rank), out / "ckpt")
    train(model, optimizer, 1, own, first=2)
    sharded.save(checkpoint(model, optimizer, own, tag=20 + rank), out / "ckpt")  # replaces the first
    seen["after_replacing"] = {
        "epoch": sharded.load(out / "ckpt", keys=[])["epoch"],
        "beside": sorted(name for name in os.listdir(out) if name.startswith(".ckpt")),
    }
    broken = checkpoint(model, optimizer, own, tag=30 + rank)
    if rank == 1:
        first = next(iter(broken["optimizer_states"][0]["state"]))
        broken["optimizer_states"][0]["state"][first]["poison"] = Unpicklable()
    try:
        sharded.save(broken, out / "ckpt")
        seen["failed_save"] = None
    except Exception as error:
        seen["failed_save"] = f"{type(error).__name__}: {error}"
    seen["other_stage_on_meta"] = all(
        p.is_meta for i, layer in enumerate(model) if i not in own for p in layer.parameters()
    )
    dist.barrier()
    if rank != 0:  # rank 0 takes no part: load is no collective
        loaded = sharded.load(out / "ckpt", keys=seen["own_keys"])
        torch.save(loaded, out / f"loaded{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


def overwrite(out: Path) -> None:
    """Saves 8 MB checkpoints numbered 0, 1, 2, ... to OUT/ckpt, replacing each, until killed."""
    for number in range(10**6):
        state = {"epoch": number, "state_dict": {"w": torch.full((2**21,), float(number))}}
        sharded.save(state, out / "ckpt")
        print(f"saved {number}", flush=True)


if __name__ == "__main__":
    {"pipeline": pipeline, "overwrite": overwrite}[sys.argv[1]](Path(sys.argv[2]))
