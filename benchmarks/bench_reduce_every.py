"""FSDP's gradients reduced once a step against every micro-batch (``reduce_every_microbatch``),
measured on this machine: each layout's per-rank peak, predicted and measured, and its step time
reducing every micro-batch over reducing once.

The app's HF Llama (the measured layout table's, ``bench_layout_measured.py``) on 4 gloo processes of
one thread each, under FSDP layouts of several micro-batches: each is fitted and predicted by the
search's own functions (``search_config(only=...)``, ``cluster=local``), then trained through a real
``Trainer`` both ways, rounds interleaved (:func:`bench_layout_measured.worker`: warm-up steps, timed
steps, one step counted by ``LiveBytes``). A row's step is the median over rounds of its slowest
rank; the ratio is the median over rounds of the two ways' steps in the same round.

    python benchmarks/bench_reduce_every.py --rounds 3 --out benchmarks/RESULTS_reduce_every.md
"""

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List

from bench_layout_measured import CASES, _compose, _named, measured, overrides, worker
from harness.machine import machine
from harness.ranks import ranks_arguments, run_ranks

WORLD = 4
#: (pp, dp_shard, schedule, chunks): sharded layouts of several micro-batches on 4 processes
LAYOUTS = [(2, 2, "1f1b", 2), (2, 2, "1f1b", 4), (2, 2, "gpipe", 2), (1, 4, "gpipe", 2), (1, 4, "gpipe", 4)]


def rows(args: Any) -> List[Dict[str, Any]]:
    """Each layout reducing once and every micro-batch, as the search fits and predicts them."""
    from pipeckpt.layout.candidates import Candidate
    from pipeckpt.layout.report import format_row
    from pipeckpt.plan_layout import search_config

    cfg = _compose(overrides(CASES["llama"], WORLD, args.batch))
    out = []
    for every in (False, True):
        wanted = [
            Candidate(pp, 1, WORLD // pp // k, k, s, 1, m, reduce_every=every) for pp, k, s, m in LAYOUTS
        ]
        for r in search_config(cfg, only=wanted).searched.ranked:
            c = r.candidate
            out.append(
                {
                    "layout": _named(replace(c, reduce_every=False)),
                    "every": every,
                    "pick": {"settings": c.settings(), "dp": c.dp, "row": format_row(1, r)},
                    "pp": c.pp,
                    "predicted_s": r.estimate.step_s,
                    "predicted_peaks": list(r.fitted.peaks),
                    "modes": list(c.modes),
                }
            )
    return sorted(out, key=lambda r: (r["layout"], r["every"]))


def table(rows: List[Dict[str, Any]]) -> List[str]:
    mib = 2**20
    lines = [
        "| layout | gradients reduced | predicted peak MiB per pp rank | measured | error "
        "| measured ms | every / once, measured (median of rounds) | predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["layout"], r["every"]): r for r in rows}
    for r in rows:
        errs = [p / m - 1 for p, m in zip(r["predicted_peaks"], r["measured_peaks"])]
        once = by.get((r["layout"], False))
        ratio = pred = ""
        if r["every"] and once is not None:
            ratio = f"{statistics.median(e / o for e, o in zip(r['rounds_s'], once['rounds_s'])):.3f}"
            pred = f"{r['predicted_s'] / once['predicted_s']:.3f}"
        lines.append(
            f"| {r['layout']} | {'every micro-batch' if r['every'] else 'once a step'} "
            f"| {' / '.join(f'{p / mib:.1f}' for p in r['predicted_peaks'])} "
            f"| {' / '.join(f'{m / mib:.1f}' for m in r['measured_peaks'])} "
            f"| {' / '.join(f'{100 * e:+.1f}%' for e in errs)} | {r['measured_s'] * 1e3:.0f} "
            f"| {ratio} | {pred} |"
        )
    return lines


def main() -> None:
    parser = ranks_arguments(__doc__.splitlines()[0], out="/dev/stdout", rounds=3, batch=16)
    parser.set_defaults(timeout=3000)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    start = time.time()
    found = rows(args)
    spec = {"overrides": overrides(CASES["llama"], WORLD, args.batch), "rows": found}
    spec.update({k: vars(args)[k] for k in ("warmup", "timed", "rounds")})
    results = run_ranks(__file__, WORLD, spec, timeout=args.timeout)
    measured(results, found, args.rounds)
    lines = [
        f"On {machine()}, from {time.strftime('%H:%M UTC', time.gmtime(start))}: the app's HF Llama on "
        f"{WORLD} processes, global batch {args.batch}, {args.warmup} warm-up + {args.timed} timed steps, "
        f"{args.rounds} rounds interleaved, {time.time() - start:.0f} s.",
        "",
        *table(found),
        "",
    ]
    if args.out == "/dev/stdout":
        print("\n".join(lines))
    else:
        Path(args.out).write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
