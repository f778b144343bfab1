"""Step time and activation memory of pipeckpt's checkpoint modes against their peers.

One invocation measures, on the same GPT-2-small-sized decoder and the same batch:
plain training, a plain micro-batch loop (the floor for micro-batching on one device),
``torch.utils.checkpoint`` per block, torchgpipe's ``GPipe`` in its three modes, and
pipeckpt's local engine in each mode plus one per-stage mix. It times
forward + backward + optimizer step at module level, so the figures compare schedules
and checkpointing, not Lightning's loop (one ``Trainer`` step is timed as an extra line).

Why the measuring is done this way:

- Memory: ``MemTracker`` sees every tensor an operator creates, but dispatch modes are
  thread-local and torchgpipe runs partitions on worker threads, so the same tracker is
  pushed onto each worker thread's mode stack. Activation memory is tracked live bytes
  minus parameters, buffers, gradients and optimizer state. MemTracker's own peak is the
  peak of the *total*, so the running maximum of the activation figure is kept here.
- Gradients still on their way: when all micro-batches run through one ``backward()``
  (a pipeline without reentrant checkpointing), the autograd engine sums each weight's
  per-micro-batch gradients in its input buffer and hands them to ``.grad`` only after
  the last one. MemTracker files that buffer as temporary memory; here it is counted as
  gradient (it becomes ``.grad``), and the MemTracker-category figure is shown beside it.
- Time: a shared 2-core machine drifts by several percent within a minute, so methods run
  interleaved. After one warm-up step each, every round runs each method once in small
  groups with the plain baseline re-run between groups; a method's ratio is against the
  mean of the two plain runs around it, and the median over rounds is reported. Both
  wall-clock and process CPU time are recorded: with one torch thread the CPU time of
  the process is the work done, and it is far less disturbed by other tenants.

Commands::

    python benchmarks/bench_checkpoint.py --rounds 3 --out benchmarks/RESULTS.md   # ~12 min
    python benchmarks/bench_checkpoint.py --quick --out /tmp/RESULTS.md            # seconds

The parts, beside this script: checkpoint_methods.py (the config and the methods),
checkpoint_memory.py (the tracker), checkpoint_measure.py (memory, time, the correctness check),
checkpoint_report.py (the Markdown). The names other benchmarks import from here are re-exported.
"""

import argparse
import sys
import time
from typing import Optional, Sequence

import torch
from checkpoint_measure import (
    Checks,
    check,
    lightning_step,
    make_batch,
    measure_accumulating,
    measure_memory,
    measure_time,
    timed_step,
)
from checkpoint_memory import ActivationTracker, mark_pending_gradients, tracked
from checkpoint_methods import (
    CPU,
    FULL,
    LR,
    MIX,
    QUICK,
    Config,
    ForwardBackward,
    Method,
    Probe,
    build_methods,
    lm_loss,
    micro_batch_loop,
    per_block,
    whole_batch,
)
from checkpoint_report import accumulating_table, fmt, median, report, results_table, rounds_table, targets

__all__ = [
    "ACCUMULATION_KEYS",
    "CPU",
    "FULL",
    "LR",
    "MIX",
    "QUICK",
    "ActivationTracker",
    "Checks",
    "Config",
    "ForwardBackward",
    "Method",
    "Probe",
    "accumulating_table",
    "build_methods",
    "check",
    "fmt",
    "lightning_step",
    "lm_loss",
    "main",
    "make_batch",
    "mark_pending_gradients",
    "measure_accumulating",
    "measure_memory",
    "measure_time",
    "median",
    "micro_batch_loop",
    "per_block",
    "report",
    "results_table",
    "rounds_table",
    "targets",
    "timed_step",
    "tracked",
    "whole_batch",
]


ACCUMULATION_KEYS = (
    "plain",
    "per-block",
    "torchgpipe-never",
    "torchgpipe-always",
    "pipeckpt-never",
    "pipeckpt-always",
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--group", type=int, default=2, help="methods between two runs of the plain baseline")
    parser.add_argument(
        "--quick", action="store_true", help="tiny model and one round: checks the harness, not the figures"
    )
    parser.add_argument("--out", default=None, help="write the Markdown results here")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    cfg = QUICK if args.quick else FULL
    command = " ".join(["python benchmarks/bench_checkpoint.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {text}", flush=True)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = cfg.layers()
    model.train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    methods = build_methods(model, cfg)
    x, y = make_batch(cfg)
    log(f"model {params / 1e6:.1f}M parameters, {len(methods)} methods")

    results = {}
    for m in methods:
        results[m.key] = measure_memory(m, model, x, y, seed=1234)
        log(
            f"memory {m.key}: held {fmt(m.held_mib, 1)}, peak {fmt(m.peak_mib, 1)}, "
            f"categories {fmt(m.categories_mib, 1)} MiB"
        )
    checks = check(results)
    del results
    for line in checks.lines:
        log(line)
    for m in methods:
        if m.key in ACCUMULATION_KEYS:
            measure_accumulating(m, model, x, y)
            log(f"accumulating {m.key}: {fmt(m.accumulating_mib, 1)} MiB")

    measure_time(methods, x, y, optimizer, rounds=rounds, group=args.group, log=log)
    lightning = lightning_step(cfg, x, y, methods[0], optimizer, steps=2)
    log(f"lightning step: {lightning[1]:.2f}x plain CPU, {lightning[0]:.2f}x wall")

    text = report(
        cfg=cfg,
        command=command,
        rounds=rounds,
        methods=methods,
        checks=checks,
        lightning=lightning,
        params=params,
        elapsed=time.perf_counter() - started,
    )
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        log(f"wrote {args.out}")
    print(text)
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
