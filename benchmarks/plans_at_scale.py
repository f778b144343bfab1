"""One rank's predicted memory for Llama 3 8B, 70B and 405B under PP x TP x FSDP2, beside the
formulas of ZeRO (Rajbhandari et al. 2020) and Korthikanti et al. (2022).

Each plan builds one tensor-parallel rank's share of the model (``pipeckpt.app.models.llama``) in
bf16 on fake tensors, profiles one micro-batch of 8192-token sequences (three blocks, repeated:
``pipeckpt.memory.repeated``), walks each stage's schedule and shards the state
(``pipeckpt.memory.sharding``). Prints the Markdown of docs/MEMORY.md, "Per rank under FSDP2, TP and
PP"::

    python benchmarks/plans_at_scale.py > /tmp/plans.md      # a few minutes on 2 cores
"""

import sys
import time
from typing import List, NamedTuple, Tuple

import torch
import torch.nn.functional as F

from pipeckpt.app.models.llama import LLAMA_SIZES, llama_config, llama_layers
from pipeckpt.checkpointing.modes import parse_mode
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import fake_mode, profile
from pipeckpt.memory.rank_peak import rank_table
from pipeckpt.memory.repeated import repeat_layer, shortened
from pipeckpt.memory.sharding import Layout, shard_numel
from pipeckpt.stages.partition import StagePlan

S = 8192  # tokens per sequence, torchtitan's Llama 3 runs
GiB = 2**30


class Plan(NamedTuple):
    title: str
    size: str
    pp: int
    tp: int
    fsdp: int
    balance: Tuple[int, ...]
    chunks: int  # micro-batches per step
    micro: int  # sequences per micro-batch
    mode: str
    schedule: str
    reshard: bool


PLANS: List[Plan] = [
    Plan("8B, pp2 x fsdp4, 1F1B, 8 micro-batches of 1, selective", "8B", 2, 1, 4, (17, 17), 8, 1,
         "selective", "1f1b", False),
    Plan("8B, fsdp8 (no PP), one micro-batch of 2, selective (torchtitan's Table 1)", "8B", 1, 1, 8,
         (34,), 1, 2, "selective", "gpipe", True),
    Plan("70B, pp8 x fsdp8, 1F1B, 16 micro-batches of 1, full AC per block", "70B", 8, 1, 8,
         (11, 10, 10, 10, 10, 10, 10, 11), 16, 1, "always:1", "1f1b", False),
    Plan("70B, tp8 x fsdp32 (no PP), one micro-batch of 16, full AC per block (torchtitan's Table 4)",
         "70B", 1, 8, 32, (82,), 1, 16, "always:1", "gpipe", True),
    Plan("405B, pp8 x tp8 x fsdp8, 1F1B, 32 micro-batches of 1, full AC per block (torchtitan's Table 5)",
         "405B", 8, 8, 8, (16,) * 8, 32, 1, "always:1", "1f1b", False),
]  # fmt: skip


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def korthikanti(plan: Plan) -> float:
    """Bytes one block keeps for one micro-batch: ``sbh(10 + 24/t)`` (no sequence parallelism, no
    attention scores: flash attention) without recompute, ``2sbh`` with full recompute."""
    h = LLAMA_SIZES[plan.size][1]
    sbh = S * plan.micro * h
    return 2 * sbh if plan.mode.startswith("always") else sbh * (10 + 24 / plan.tp)


def run(plan: Plan) -> None:
    started = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with fake_mode():
        config = llama_config(plan.size, seq_len=S, tensor_parallel=plan.tp)
        layers = llama_layers(config)
        short, index, count = shortened(layers)
        tokens = torch.randint(256, (plan.micro, S))
        fitted = profile(short, tokens, loss_fn=loss, target=tokens, fake=True, flops_per_s=400e12)
    torch.set_default_dtype(torch.float32)
    fitted = repeat_layer(fitted, index, count)
    mode = parse_mode(plan.mode)
    stage_plan = StagePlan(
        balance=plan.balance, devices=(torch.device("cpu"),) * plan.pp, modes=(mode,) * plan.pp
    )
    prediction = predict(fitted, stage_plan, chunks=plan.chunks, optimizer="adamw", schedule=plan.schedule)
    layout = Layout(fsdp=plan.fsdp, tp=plan.tp, reshard_after_forward=plan.reshard, precision="bf16-mixed")
    table = rank_table(prediction, layers, stage_plan.ranges, layout, "adamw")
    print(f"**{plan.title}** (GiB per rank; profiled in {time.perf_counter() - started:.0f} s)\n")
    print(
        "| stage | layers | params | grads | AdamW | unsharded | collectives | activations | boundary "
        "| working | **peak** | in flight | ZeRO-3 states | Korthikanti activations |"
    )
    print("|---" * 14 + "|")
    per_block = korthikanti(plan)
    for rank, stage in zip(table.ranks, prediction.stages):
        a, b = rank.layers
        psi = sum(p.numel() for layer in list(layers)[a:b] for p in layer.parameters())
        blocks = sum(1 for layer in list(layers)[a:b] if type(layer).__name__ == "Block")
        zero3 = 16 * psi / plan.fsdp  # 2 + 2 + 12 bytes per parameter, all sharded
        st = rank.state
        cells = [st.params, st.grads, st.optimizer, st.unsharded, st.collectives]
        cells += [rank.activations, rank.boundary, rank.working]
        print(
            f"| {rank.stage} | {a}-{b - 1} | "
            + " | ".join(f"{c / GiB:.1f}" for c in cells)
            + f" | **{rank.peak / GiB:.1f}** | {stage.in_flight} | {zero3 / GiB:.1f} | "
            + f"{per_block * blocks * stage.in_flight / GiB:.1f} |"
        )
    block = fitted.layers[index]
    saved = fitted.bytes_of(set(block.saved) | set(block.inputs))
    sbh = S * plan.micro * LLAMA_SIZES[plan.size][1]
    print(
        f"\nOne block saves {saved / GiB:.2f} GiB per micro-batch without recompute ({saved / sbh:.1f} sbh);"
    )
    print(f"largest FSDP unit gathered: {max(_unit(u, plan.fsdp) for u in layers) / GiB:.2f} GiB in bf16.\n")
    sys.stdout.flush()


def _unit(layer: torch.nn.Module, fsdp: int) -> int:
    return 2 * fsdp * sum(shard_numel(p.shape, fsdp) for p in layer.parameters())


def main() -> None:
    for plan in PLANS:
        run(plan)


if __name__ == "__main__":
    main()
