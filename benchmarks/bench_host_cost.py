"""Host cost of the distributed engine against a hand-written ``torch.distributed.pipelining`` script.

The dispatch-bound proxy: ``depth`` x ``Linear(width, width)``, 2 gloo processes of one torch
thread, 2 stages of equal halves, 1F1B over ``chunks`` micro-batches, AdamW, MSE loss. Its kernels
are so small that a step's time is mostly Python and dispatch, so any per-step or per-micro-batch
work of the engine shows in full (as on a GPU whose kernels outrun the host).

- ``raw``: what a user would write by hand: ``PipelineStage`` + ``Schedule1F1B`` on each rank's
  half, ``zero_grad``, ``schedule.step``, ``optimizer.step``, batches from the same ``DataLoader``.
- ``lightning``: the raw script's stage and schedule inside a Lightning ``Trainer`` (one device per
  process, automatic optimization, ``backward`` a no-op since the schedule runs it): what Lightning's
  loop costs any pipeline, the floor under which no strategy can go. ``pipeckpt / lightning`` is the
  engine's own host cost.
- ``pipeckpt``: the same module, data and optimizer through a Lightning ``Trainer`` with
  ``PipelineStrategy(engine="distributed")``. Its losses are asserted equal to the raw script's to
  the bit, every step, and so are both ranks' weights after the run.

Measuring: process CPU time (``time.process_time``: every thread of the process, gloo's included)
and wall time per optimizer step after warm-up, on each rank; a step's CPU is the *sum over both
ranks* (the host work one step costs), its wall time the slower rank's. Rounds are interleaved
(each method first in turn); a ratio is taken within each round, the median reported.
The schedule's own part is timed too: the engine's ``run`` + ``take_step_gradients`` against the raw
``schedule.step``; the rest of a pipeckpt step is Lightning's loop and the optimizer.

Commands::

    python benchmarks/bench_host_cost.py --rounds 9 --out /tmp/host_cost.md   # ~1.5 min, idle 2 cores
    python benchmarks/bench_host_cost.py --quick --out /tmp/host_cost.md      # seconds: checks the harness
    python benchmarks/bench_host_cost.py --calls --out /tmp/host_calls.md     # ~1 min: Python calls per step

``--parts`` splits a step of Lightning + raw and of pipeckpt into its parts, by the main thread's
CPU time (``time.thread_time``) spent in each of a few methods that both runs call: the schedule's
``step``, the stage's ``forward_one_chunk`` and ``backward_one_chunk``, and the strategy's
``training_step``, ``backward`` and ``optimizer_step`` (which runs the closure: training_step,
zeroing, backward, then the optimizer; Lightning + raw zeroes inside its ``training_step``, as the
raw script does, pipeckpt in Lightning's own zeroing). Rounds alternate which runs first; each
part's difference is the median of the per-round differences, per rank: where the engine's own
cost sits.

    python benchmarks/bench_host_cost.py --parts --rounds 14 --out /tmp/host_parts.md  # ~1 min

``--calls`` counts instead of timing: the Python and builtin function calls (cProfile's count) each
rank makes per step, the same on every run and under any load, where the CPU ratios of this 2-core
machine resolve about +-0.03. A count weighs every call alike, a tensor operation made by an operator
not at all: it tells where the engine's own Python went, the CPU ratio what it costs.

The pieces live beside this script: the three runs in ``host_cost_methods.py``, the timers
(``Clock``, ``Parts``) in ``host_cost_clock.py``, the tables in ``host_cost_report.py``.
"""

import json
import os
import sys
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from harness.ranks import ranks_arguments, run_ranks
from host_cost_clock import Clock, Parts
from host_cost_methods import METHODS, lightning, pipeckpt, raw
from host_cost_report import per_round, report, report_calls, report_parts
from torch import Tensor


def worker(spec_path: str) -> None:
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("pin") and len(os.sched_getaffinity(0)) >= 2:  # each rank and its gloo threads on a core
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})
    dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=2)
    if spec.get("parts"):
        rows = parts_rows(spec)
    else:
        rows = timed_rows(spec)
    with open(os.path.join(spec["out"], f"rank{os.environ['LOCAL_RANK']}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def parts_rows(spec: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``--parts``: each round's parts of a step, Lightning + raw and pipeckpt, first in turn."""
    parts, rows = Parts(), []
    Clock.parts = parts
    for r in range(spec["rounds"]):
        for method in ("lightning", "pipeckpt") if r % 2 == 0 else ("pipeckpt", "lightning"):
            dist.barrier()
            {"lightning": lightning, "pipeckpt": pipeckpt}[method](spec)
            assert Clock.last is not None
            rows.append({"round": r, "method": method, "rank": dist.get_rank(), **parts.per_step(Clock.last)})
    return rows


def timed_rows(spec: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each round's per-step times of every method (each first in turn), checked equal in losses
    and weights to the raw script's."""
    rows = []
    for r in range(spec["rounds"]):
        order = METHODS[r % 3 :] + METHODS[: r % 3]  # each method first in turn
        ran: Dict[str, Tuple[Dict[str, float], List[float], List[Tensor]]] = {}
        for method in order:
            dist.barrier()
            ran[method] = {"raw": raw, "lightning": lightning, "pipeckpt": pipeckpt}[method](spec)
        for method in METHODS[1:]:
            if dist.get_rank() == 1:  # the last stage holds the raw script's losses
                assert ran["raw"][1] == ran[method][1], (method, ran["raw"][1], ran[method][1])
            for a, b in zip(ran["raw"][2], ran[method][2], strict=True):
                assert torch.equal(a, b), f"{method}'s weights differ from the raw script's"
        for method in METHODS:
            rows.append({"round": r, "method": method, "rank": dist.get_rank(), **ran[method][0]})
    return rows


def load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main() -> None:
    parser = ranks_arguments(__doc__.splitlines()[0], out="/tmp/host_cost.md", rounds=9, batch=64)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--pin", action="store_true", help="each rank on a core of its own")
    parser.add_argument("--calls", action="store_true", help="count Python calls per step instead of timing")
    parser.add_argument(
        "--parts", action="store_true", help="split a step into parts by the main thread's CPU"
    )
    parser.set_defaults(warmup=5, timed=30)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        # Its rows are written and its group destroyed: leave without the interpreter's teardown, where
        # a C++ thread of the finished run was now and then destroyed still joinable ("terminate called
        # without an active exception", an abort after the work was done, seen under a loaded CI run).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.quick:
        args.depth, args.width, args.batch, args.warmup, args.timed, args.rounds = 4, 16, 8, 1, 2, 1
    if args.calls:  # a count: one round gives it
        args.rounds = 1
    spec = {
        k: getattr(args, k)
        for k in (
            "depth",
            "width",
            "batch",
            "chunks",
            "warmup",
            "timed",
            "rounds",
            "quick",
            "pin",
            "calls",
            "parts",
        )
    }
    began, loads = time.time(), [load_average()]
    rows = run_ranks(__file__, 2, spec, timeout=args.timeout)
    loads.append(load_average())
    if args.calls:
        text = report_calls(spec, rows, time.time() - began)
    elif args.parts:
        text = report_parts(spec, rows, time.time() - began)
    else:
        text = report(spec, per_round(rows, args.rounds), loads, time.time() - began)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
