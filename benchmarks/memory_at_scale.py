"""The memory model's per-stage prediction for a 70B-class decoder, beside Korthikanti et al. (2022).

Builds pipeckpt's GPT (80 blocks, d 8192, 64 heads, seq 4096, vocab 32000, dropout 0.1) in bf16
on fake tensors (nothing allocated), profiles one micro-batch of one sequence with
:func:`pipeckpt.memory.profile.profile`, and predicts each of 8 pipeline stages (8-way data parallelism
does not change a stage's memory without sharding) under torch's 1F1B and GPipe, without
recompute and with full recompute. Prints the Markdown tables of docs/MEMORY.md::

    python benchmarks/memory_at_scale.py > /tmp/at_scale.md     # about a minute
"""

import sys
import time

import torch
import torch.nn.functional as F

from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.checkpointing.modes import ALWAYS, NEVER
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import fake_mode, profile
from pipeckpt.stages.partition import StagePlan

S, H, A, L, V = 4096, 8192, 64, 80, 32000  # sequence, hidden, heads, layers, vocabulary
B = 1  # micro-batch, sequences
STAGES, CHUNKS = 8, 32
BALANCE = (11, 10, 10, 10, 10, 10, 10, 12)  # embedding + 10 blocks, 10 blocks x 6, 10 blocks + norm + head
GiB = 2**30


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def main() -> None:
    started = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with fake_mode():
        seq = gpt_layers(vocab_size=V, d_model=H, n_heads=A, n_layers=L, seq_len=S, dropout=0.1)
        tokens, target = torch.randint(V, (B, S)), torch.randint(V, (B, S))
        fitted = profile(seq, tokens, loss_fn=loss, target=target, fake=True, flops_per_s=400e12)
    torch.set_default_dtype(torch.float32)
    block = fitted.layers[1]
    sbh = S * B * H
    saved = fitted.bytes_of(set(block.saved) - set(block.inputs)) + fitted.bytes_of(set(block.inputs))
    print(f"profiled in {time.perf_counter() - started:.0f} s (fake tensors)\n")
    print("| per transformer layer, one micro-batch | bytes | / sbh |")
    print("|---|---|---|")
    print(
        f"| pipeckpt profile: saved for backward (bf16, SDPA) | {saved / GiB:.3f} GiB | {saved / sbh:.1f} |"
    )
    k_no_scores = 34 * sbh
    k_full = sbh * (34 + 5 * A * S / H)
    print(f"| Korthikanti: sbh(34 + 5as/h), no recompute | {k_full / GiB:.3f} GiB | {k_full / sbh:.1f} |")
    print(f"| Korthikanti: 34 sbh (flash attention: no scores) | {k_no_scores / GiB:.3f} GiB | 34.0 |")
    kept = fitted.bytes_of(set(block.inputs))
    print(f"| pipeckpt profile: layer input (full recompute) | {kept / GiB:.3f} GiB | {kept / sbh:.1f} |")
    print(f"| Korthikanti: 2 sbh, full recompute | {2 * sbh / GiB:.3f} GiB | 2.0 |")
    print()
    for schedule in ("1f1b", "gpipe"):
        for mode in (NEVER, ALWAYS):
            plan = StagePlan(balance=BALANCE, devices=(torch.device("cpu"),) * STAGES, modes=(mode,) * STAGES)
            p = predict(fitted, plan, chunks=CHUNKS, optimizer="adam", schedule=schedule)
            print(
                f"**{schedule}, {mode.name}, {CHUNKS} micro-batches of {B} x {S} tokens** (GiB per stage; "
                f"step {p.step_time_s:.1f} s at 400 TFLOP/s)\n"
            )
            columns = (
                "stage layers params grads Adam-state activations boundary working peak in-flight Korthikanti"
            )
            print("| " + " | ".join(columns.split()) + " |")
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for s in p.stages:
                blocks = sum(1 for i in range(*s.layers) if fitted.layers[i].name == "Block")
                per_mb = (k_full if mode is NEVER else 2 * sbh) * blocks
                korth = per_mb * s.in_flight
                print(
                    f"| {s.stage} | {s.layers[0]}-{s.layers[1] - 1} | {s.params / GiB:.1f} | "
                    f"{s.grads / GiB:.1f} | "
                    f"{s.optimizer / GiB:.1f} | {s.activations / GiB:.1f} | {s.boundary / GiB:.2f} | "
                    f"{s.working / GiB:.1f} | **{s.peak / GiB:.1f}** | {s.in_flight} | {korth / GiB:.1f} |"
                )
            print()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
