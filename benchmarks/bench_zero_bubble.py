"""Zero-bubble schedules against 1F1B, every stage under ``checkpoint="always"``, on two processes.

The project's MLP (``pipeckpt.app.models.MLP``) in a pipeline of two processes of one torch thread
each, through a real ``Trainer`` with ``PipelineStrategy(engine="distributed")``: ``1f1b`` (one stage
per process) and ``interleaved_1f1b`` (two per process, the looped baseline with a whole backward)
against ``interleaved_zero_bubble``, ``zbv_zero_bubble`` and ``dual_pipe_v`` (two per process, each
micro-batch's backward split into an input pass and a weight pass; a recomputing stage recomputes
once, in the input pass, pipeckpt/stages/weight_pass.py). Side by side in the same two processes,
in rounds whose order rotates; each figure is the median over rounds of a run's mean step time, and
ratios are against ``1f1b``'s time in the same round.

Commands::

    python benchmarks/bench_zero_bubble.py --rounds 3 --out /tmp/RESULTS_zero_bubble.md   # ~5 min
    python benchmarks/bench_zero_bubble.py --quick --out /tmp/RESULTS_zero_bubble.md

benchmarks/RESULTS.md's zero-bubble section is such a run's output.
"""

import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List

from bench_distributed import model_settings, train
from harness.machine import machine
from harness.ranks import joined, ranks_arguments, run_ranks

from pipeckpt import PipelineStrategy
from pipeckpt.app.models import MLP

# schedule -> stages per process
SCHEDULES = {
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "interleaved_zero_bubble": 2,
    "zbv_zero_bubble": 2,
    "dual_pipe_v": 2,
}


def worker(spec_path: str) -> None:
    spec, args = joined(spec_path)
    names = list(SCHEDULES)
    results = []
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for schedule in names[shift:] + names[:shift]:
            v = SCHEDULES[schedule]
            strategy = PipelineStrategy(
                engine="distributed",
                stages=2 * v,
                virtual_stages=v,
                chunks=args.chunks,
                schedule=schedule,
                checkpoint="always",
            )
            model = spec["model"]
            measure = train(strategy, devices=2, batch=args.batch, accumulate=1, args=args, model=model)
            results.append({"round": round_, "schedule": schedule, "seconds": measure.seconds_per_step()})
    with open(os.path.join(spec["out"], f"rank{os.environ['LOCAL_RANK']}.json"), "w") as f:
        json.dump(results, f)


def report(
    args: argparse.Namespace, model: Dict[str, int], rows: List[Dict[str, Any]], elapsed: float
) -> str:
    # A step ends when both ranks are done: the slower rank's time per (round, schedule).
    by: Dict[Any, float] = {}
    for r in rows:
        key = (r["round"], r["schedule"])
        by[key] = max(by.get(key, 0.0), r["seconds"])
    params = sum(p.numel() for p in MLP(**model).parameters())
    lines = [
        '## Zero-bubble schedules against 1F1B under `checkpoint="always"` '
        "(`benchmarks/bench_zero_bubble.py`)",
        "",
        f"Machine: {machine()}. Two processes of one torch thread each; gloo on localhost.",
        f"Model: `pipeckpt.app.models.MLP({', '.join(f'{k}={v}' for k, v in model.items())})` "
        f"({params / 1e6:.1f}M parameters, fp32, AdamW), batch {args.batch}, {args.chunks} micro-batches, "
        "stages balanced by parameters, every stage `always`. Each figure: the mean step time over "
        f"{args.timed} steps after {args.warmup} warm-up steps, through a `Trainer`, the slower rank's; "
        f"median of {args.rounds} rounds (the schedules' order rotates from round to round); ratio = "
        f"the schedule's time / `1f1b`'s in the same round, median. Wall time of the run: "
        f"{elapsed / 60:.1f} min. Command: `python benchmarks/bench_zero_bubble.py"
        f"{' --quick' if args.quick else ''} --rounds {args.rounds}`.",
        "",
        "| schedule | stages per process | backward | step ms | / 1f1b |",
        "|---|---|---|---|---|",
    ]
    for schedule, v in SCHEDULES.items():
        times = [by[(n, schedule)] for n in range(args.rounds)]
        ratios = [by[(n, schedule)] / by[(n, "1f1b")] for n in range(args.rounds)]
        split = "input, then weight pass" if "zero" in schedule or "dual" in schedule else "whole"
        lines.append(
            f"| `{schedule}` | {v} | {split} | {statistics.median(times) * 1e3:.1f} | "
            f"{statistics.median(ratios):.2f} |"
        )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = ranks_arguments(__doc__.splitlines()[0], out="/tmp/RESULTS_zero_bubble.md", rounds=3, batch=256)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.quick:
        args.batch, args.warmup, args.timed, args.rounds = 32, 1, 2, 1
    model = model_settings(True) if args.quick else dict(in_features=512, hidden=512, depth=8, num_classes=10)
    began = time.time()
    rows = run_ranks(__file__, 2, {"args": vars(args), "model": model}, timeout=args.timeout)
    text = report(args, model, rows, time.time() - began)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
