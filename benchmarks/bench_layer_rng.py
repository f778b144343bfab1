"""Cost of per-layer random streams (``layer_rng``) on the local engine, CPU time per step.

Models: ``benchmarks/bench_dispatch.py``'s proxy (48 x Linear(64, 64) + GELU, batch 16, 4 stages,
4 chunks), the same with a Dropout(0.1) in every block (the worst case: every layer seeded), and a
small GPT (``pipeckpt.app.models.gpt``, 4 blocks, d_model 128, seq 64, batch 8, dropout 0.1). Each
step: forward, mean-square loss, backward, under ``except_last``. Interleaved rounds, median ratio.

    python benchmarks/bench_layer_rng.py            # ~1 min
"""

import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
from bench_dispatch import proxy
from torch import nn

from pipeckpt.app.models.gpt import gpt_layers
from pipeckpt.checkpointing.layer_rng import LayerStreams
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.stages.partition import plan

CPU = torch.device("cpu")


def pipeline(model: nn.Sequential, scope: str) -> LocalPipeline:
    p = plan(model, devices=[CPU], stages=4, checkpoint="except_last")
    pipe = LocalPipeline(model, p, chunks=4)
    streams = LayerStreams(scope)
    streams.start(0)
    streams.attach(list(model), [CPU] * len(model))
    if streams.enabled:
        pipe.streams = streams
        for s in pipe.stages:
            s.streams = streams
    return pipe


def step_of(pipe: LocalPipeline, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        out = pipe.forward(x)
        out.float().pow(2).mean().backward()

    return step


def ratio(make: Callable[[], nn.Sequential], x: torch.Tensor, rounds: int, reps: int) -> Dict[str, float]:
    steps = {}
    for scope in ("off", "auto", "all"):
        model = make()
        steps[scope] = step_of(pipeline(model, scope), x)
        steps[scope]()  # warm up
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for r in range(rounds):
        order = list(steps)[r % 3 :] + list(steps)[: r % 3]
        for k in order:
            t = time.process_time()
            for _ in range(reps):
                steps[k]()
            times[k].append((time.process_time() - t) / reps)
    out = {"off ms": statistics.median(times["off"]) * 1e3}
    for k in ("auto", "all"):
        out[f"{k}/off"] = statistics.median(a / b for a, b in zip(times[k], times["off"]))
    return out


def main() -> int:
    torch.set_num_threads(1)
    rounds, reps = (3, 2) if "--quick" in sys.argv else (15, 10)

    def dropout_proxy() -> nn.Sequential:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1)) for _ in range(48)]
        return nn.Sequential(*blocks)

    def gpt() -> nn.Sequential:
        torch.manual_seed(0)
        return gpt_layers(vocab_size=256, d_model=128, n_heads=4, n_layers=4, seq_len=64, dropout=0.1)

    cases = [
        ("proxy (no dropout)", proxy, torch.randn(16, 64)),
        ("proxy, Dropout in every block", dropout_proxy, torch.randn(16, 64)),
        ("GPT 4 x d128, seq 64, batch 8", gpt, torch.randint(0, 256, (8, 64))),
    ]
    print("| model | off: ms per step | auto / off | all / off |\n|---|---|---|---|")
    for name, make, x in cases:
        r = ratio(make, x, rounds, reps)
        print(f"| {name} | {r['off ms']:.2f} | {r['auto/off']:.3f} | {r['all/off']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
