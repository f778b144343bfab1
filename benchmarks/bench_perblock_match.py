"""pipeckpt shaped like ``torch.utils.checkpoint`` per block, against it, on the frontier's FULL config.

Per-block checkpointing (``bench_checkpoint.per_block``) checkpoints the 12 transformer blocks and runs
the embedding, final norm and head plainly. The pipeckpt plans here do the same at one chunk: the
embedding alone on stage 0 under ``never`` (one micro-batch that is not recomputed runs without the
stage's Function), the blocks per layer (``always:1``), the norm and head under ``never`` or per layer.
Memory is printed in bytes, since the two differ by kilobytes; time as CPU time vs plain, interleaved
rounds, medians::

    python benchmarks/bench_perblock_match.py --rounds 3
"""

import argparse
import statistics
import sys
from typing import Optional, Sequence

import torch
from bench_checkpoint import FULL, LR, build_methods, make_batch, measure_memory, measure_time
from bench_frontier import per_block_shaped, pipeckpt_method
from harness.machine import machine

PLANS = [
    (("never", "always:1", "always:1", "never"), 1, (1, 6, 6, 2)),
    (("never", "always:1", "always:1", "always:1"), 1, (1, 5, 5, 4)),
    *per_block_shaped(FULL),  # only the first blocks per layer, the rest kept
]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = FULL
    torch.manual_seed(0)
    model = cfg.layers()
    x, y = make_batch(cfg)
    methods = [m for m in build_methods(model, cfg) if m.key in ("plain", "per-block")]
    methods += [pipeckpt_method(model, cfg, *key) for key in PLANS]
    for m in methods:
        measure_memory(m, model, x, y, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    measure_time(
        methods, x, y, optimizer, rounds=args.rounds, group=3, log=lambda s: print(s, file=sys.stderr)
    )
    base = methods[1]
    print(f"{machine()}; {args.rounds} interleaved rounds, CPU time vs plain, medians [range]\n")
    print("| method | peak act+grad bytes | vs per-block bytes | time vs plain [range] |")
    print("|---|---|---|---|")
    for m in methods[1:]:
        peak = round(m.footprint_mib * 2**20)
        diff = peak - round(base.footprint_mib * 2**20)
        r = m.cpu_ratios
        print(f"| {m.label} | {peak} | {diff:+d} | {statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
