"""Throughput and activation memory of the distributed engine on two processes.

A 2-stage pipeline of the project's MLP (``pipeckpt.app.models.MLP``) runs on two
processes of one torch thread each, against the same module trained in one
process with one thread. Both go through a real ``Trainer`` (the pipeline with
``PipelineStrategy(engine="distributed")``), so the figures include the engine's
whole cost: splitting the step, the schedule, gloo sends, the per-step
broadcast of the loss and logs, and Lightning's loop.

- Throughput: a pipeline of 2 equal stages and M micro-batches needs M + 1
  stage-slots per step where one process needs 2M, so its ideal speed-up is
  2M / (M + 1). Two more factors bound it on a real machine, and both are
  measured in the same run: the machine's capacity (two processes each training
  their half alone, against one process training the whole model; 2.0 on two
  independent cores) and the micro-batch efficiency (one process looping over
  the M micro-batches against the whole batch at once: smaller matrix products).
  torch's own schedules run on the same halves without Lightning or pipeckpt, so
  the engine's own cost shows as "pipeckpt / raw".
- Memory: per rank, the peak bytes of distinct storages autograd holds for
  backward (a ``saved_tensors_hooks`` counter; parameters excluded), during one
  step without checkpointing, under GPipe and 1F1B. GPipe keeps every
  micro-batch's activations until the backward phase; 1F1B keeps at most
  ``pp - rank`` micro-batches in flight on a rank.
- Time: all runs of one round happen back to back; the one-process baseline runs
  before and after the pipeline runs of the round and a ratio is against their
  mean. With more rounds the median ratio is reported.

Commands::

    python benchmarks/bench_distributed.py --rounds 3 --out benchmarks/RESULTS_distributed.md   # ~9 min
    python benchmarks/bench_distributed.py --quick --out /tmp/RESULTS_distributed.md

The section is written on its own; the distributed section of benchmarks/RESULTS.md is such a
run's output, pasted in beside the checkpointing benchmark.

The pieces live beside this script: what is measured and how in ``distributed_measure.py``, the
yardsticks and the pipeline processes' work in ``distributed_processes.py``, the report in
``distributed_report.py``.
"""

import argparse
import time
from typing import Any, Dict, List

import torch

# Measure, loader, model_settings and train are imported from here by other benchmarks
# (bench_layout_engine_cost.py, bench_zero_bubble.py): Measure and loader are re-exported.
from distributed_measure import MICROBATCHES, model_settings, train
from distributed_measure import Measure as Measure
from distributed_measure import loader as loader
from distributed_processes import plain_whole, worker
from distributed_report import report
from harness.ranks import ranks_arguments, run_ranks


def pipeline_round(args: argparse.Namespace, model: Dict[str, int]) -> List[Dict[str, Any]]:
    """Both ranks started here, as torchrun would, so no launcher process competes for a core."""
    return run_ranks(__file__, 2, {"args": vars(args), "model": model}, timeout=args.timeout)


def main() -> None:
    out = "benchmarks/RESULTS_distributed.md"
    parser = ranks_arguments(__doc__.splitlines()[0], out=out, rounds=1, batch=512)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.quick:
        args.batch, args.warmup, args.timed = 32, 1, 2
    torch.set_num_threads(1)
    model = model_settings(args.quick)
    began = time.time()
    rounds = []
    for _ in range(args.rounds):
        before = train("auto", devices=1, batch=args.batch, accumulate=1, args=args, model=model)
        whole = plain_whole(args, model)
        loop = {str(m): whole / plain_whole(args, model, m) for m in MICROBATCHES}
        pipeline = pipeline_round(args, model)
        after = train("auto", devices=1, batch=args.batch, accumulate=1, args=args, model=model)
        baseline = (before.seconds_per_step() + after.seconds_per_step()) / 2
        by_run: Dict[str, List[float]] = {}
        for r in pipeline:
            if "free" in r:
                by_run.setdefault("free", []).append(r["free"])
            else:
                by_run.setdefault(f"{r['schedule']}/{r['m']}", []).append(r["seconds"])
                by_run.setdefault(f"raw {r['schedule']}/{r['m']}", []).append(r["raw"])
        assert before.counter is not None
        rounds.append(
            {
                "baseline": baseline,
                "loop": loop,
                "capacity": whole / max(by_run.pop("free")),
                "whole": whole,
                "pipeline": {k: max(v) for k, v in by_run.items()},  # a step ends when both ranks are done
                "memory": {
                    f"{r['schedule']}/{r['m']}/{r['rank']}": r["saved_peak"]
                    for r in pipeline
                    if "free" not in r
                },
                "baseline_saved": before.counter.peak,
            }
        )
    text = report(args, model, rounds, time.time() - began)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
