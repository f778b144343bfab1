"""Peak memory and step time of checkpoint granularity and selective checkpointing, local engine, CPU.

A GPT-shaped Sequential (6 blocks, d 256, 4 heads, seq 128, vocab 8192, batch 8, dropout 0.1)
in 2 stages x 4 micro-batches, fp32, one thread. Peak per stage: its parameters plus every
storage created during one forward and backward, attributed as benchmarks/harness/stage_memory.py does
(torch's MemTracker refuses modules called once per micro-batch). Time: median of 5
interleaved rounds, as a ratio to `never`.

    python benchmarks/bench_granularity.py

Measured on the shared 2-core CPU (torch 2.13), one run:

| mode | stage 0 peak MiB | stage 1 peak MiB | time vs never |
|---|---|---|---|
| `never` | 92.5 | 219.1 | 1.00 |
| `except_last` | 59.5 | 164.3 | 1.23 |
| `always` | 59.5 | 146.0 | 1.33 |
| `always:2` | 54.0 | 148.0 | 1.35 |
| `always:1` | 52.0 | 150.0 | 1.37 |
| `selective` | 72.8 | 214.0 | 1.36 |
| `selective:1` | 69.8 | 218.0 | 1.55 |

Stage 1 holds the vocabulary head: its logits are a matmul output, which `selective` keeps, and
per-layer segments keep the head's input beside them, so only stage 0 gains from either.
"""

import statistics
import time
from typing import Dict, List

import torch
from harness.stage_memory import measure_local_step

from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

CPU = [torch.device("cpu")]
BALANCE = [4, 5]
MODES = ["never", "except_last", "always", "always:2", "always:1", "selective", "selective:1"]


def layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return gpt_layers(vocab_size=8192, d_model=256, n_heads=4, n_layers=6, seq_len=128, dropout=0.1)


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().logsumexp(-1).mean()


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(1))
    peaks: Dict[str, List[float]] = {}
    for mode in MODES:
        seq = layers()
        per_stage, _ = measure_local_step(
            seq, plan(seq, devices=CPU, balance=BALANCE, checkpoint=mode), chunks=4, batch=x, loss_fn=loss
        )
        peaks[mode] = [b / 2**20 for b in per_stage]
    engines = {}
    for mode in MODES:
        seq = layers()
        engines[mode] = LocalPipeline(seq, plan(seq, devices=CPU, balance=BALANCE, checkpoint=mode), chunks=4)
    times: Dict[str, List[float]] = {m: [] for m in MODES}
    for _ in range(5):
        for mode, engine in engines.items():
            start = time.perf_counter()
            loss(engine.forward(x)).backward()
            times[mode].append(time.perf_counter() - start)
    base = statistics.median(times["never"])
    print("| mode | stage 0 peak MiB | stage 1 peak MiB | time vs never |\n|---|---|---|---|")
    for mode in MODES:
        p0, p1 = peaks[mode]
        print(f"| `{mode}` | {p0:.1f} | {p1:.1f} | {statistics.median(times[mode]) / base:.2f} |")


if __name__ == "__main__":
    main()
