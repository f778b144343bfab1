"""Some layouts of a saved measured run (``bench_layout_measured.py --save``) trained again, to see
how a change to the engine moved their measured steps: the same model, world, batch and harness
(``harness.layout_fit``), the named rows only, rounds interleaved as the full run interleaves them.

Reported per row: the median over rounds of its slowest rank's seconds per step now, the saved
measurement, and their ratio; each row's step over the fastest's, now and then; and its peak per
pipeline rank now and as saved; with ``--allocated``, also by the CPU allocator (inside DTensor's
operators: harness.allocated_bytes), the peaks alone. ``--save FILE`` writes the saved run again
with the rows' peaks counted now (their times as saved), for ``bench_layout_measured.py
--repredict FILE``: how the harness's counting changed moves no measured step.

    python benchmarks/bench_layout_remeasure.py benchmarks/layout_measured_llama4_2026-12-02.json \\
        "pp4 x tp1 x dp1 1f1b x8" "pp2 x tp1 x dp2 gpipe x2" --rounds 5
    python benchmarks/bench_layout_remeasure.py SAVED.json --matching "(fsdp" --rounds 1 --save NEW.json
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from bench_layout_measured import __file__ as measured_script
from bench_layout_measured import _key, measured
from harness.machine import machine
from harness.ranks import run_ranks


def _mib(peaks: List[int]) -> str:
    """Per-pipeline-rank bytes as the tables give them: MiB, one decimal, ``/`` between ranks."""
    return " / ".join(f"{p / 2**20:.1f}" for p in peaks)


def _table(rows: List[Dict[str, Any]], now: List[Dict[str, Any]], allocated: bool) -> List[str]:
    """``rows`` as saved beside ``now``, their fits of this run: steps and peaks, or with
    ``allocated`` the peaks alone, counted by operator and by the CPU allocator."""
    if allocated:
        lines = [
            "| layout | peak MiB per pp rank now | saved | by the CPU allocator now | allocator / now |",
            "|---|---|---|---|---|",
        ]
        for row, new in zip(rows, now):
            counted, held = new["measured_peaks"], new["allocated_peaks"]
            ratios = " / ".join(f"{h / p:.3f}" for h, p in zip(held, counted))
            saved = _mib(row["measured_peaks"])
            lines.append(f"| {row['layout']} | {_mib(counted)} | {saved} | {_mib(held)} | {ratios} |")
        return lines
    best_now, best_then = min(r["measured_s"] for r in now), min(r["measured_s"] for r in rows)
    lines = [
        "| layout | now ms | saved ms | now / saved | over the fastest now | then "
        "| peak MiB per pp rank now | saved |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, new in zip(rows, now):
        s, then = new["measured_s"], row["measured_s"]
        lines.append(
            f"| {row['layout']} | {s * 1e3:.0f} | {then * 1e3:.0f} | {s / then:.2f} "
            f"| {s / best_now:.2f} | {then / best_then:.2f} "
            f"| {_mib(new['measured_peaks'])} | {_mib(row['measured_peaks'])} |"
        )
    return lines


def remeasure(
    saved: Dict[str, Any],
    wanted: Callable[[str], bool],
    rounds: int,
    timeout: int,
    recounted: Optional[Dict[str, Any]] = None,
    allocated: bool = False,
) -> List[str]:
    """The rows of ``saved`` that ``wanted`` takes (a row's layout name -> bool) trained again;
    ``recounted``, a copy of ``saved``, gets their peaks as counted now. ``allocated``: each counted
    by the CPU allocator too (``harness.allocated_bytes``, in a step after the timed ones), and the
    table gives the peaks only."""
    lines = [f"On {machine()}.", ""]
    for n, run in enumerate(saved["runs"]):
        rows = [r for r in run["rows"] if wanted(r["layout"])]
        if not rows:
            continue
        spec = {"overrides": run["overrides"], "rows": rows, **saved["args"], "rounds": rounds}
        spec["allocated"] = allocated
        results = run_ranks(measured_script, run["world"], spec, timeout=timeout)
        now = [copy.deepcopy(r) for r in rows]
        measured(results, now, rounds)
        lines += [f"{run['name']} on {run['world']} processes, {rounds} rounds (saved: {saved['when']})", ""]
        lines += [*_table(rows, now, allocated), ""]
        if recounted is not None:
            counted = {_key(r): r for r in now}
            for row in recounted["runs"][n]["rows"]:
                new = counted.get(_key(row), {})
                row.update({k: new[k] for k in ("measured_peaks", "allocated_peaks") if k in new})
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("saved", help="a bench_layout_measured.py --save JSON")
    parser.add_argument("layouts", nargs="*", help="rows by their layout column")
    parser.add_argument("--matching", help="also every row whose layout column contains this")
    parser.add_argument("--save", help="write the saved run again, these rows' peaks counted now")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--allocated",
        action="store_true",
        help="count each peak by the CPU allocator too (harness.allocated_bytes)",
    )
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--out", default="/dev/stdout")
    args = parser.parse_args()
    saved = json.loads(Path(args.saved).read_text())

    def wanted(layout: str) -> bool:
        return layout in args.layouts or bool(args.matching and args.matching in layout)

    recounted = copy.deepcopy(saved) if args.save else None
    lines = remeasure(saved, wanted, args.rounds, args.timeout, recounted, args.allocated)
    if recounted is not None:
        recounted["peaks_recounted"] = f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {sys.argv[1:]}"
        Path(args.save).write_text(json.dumps(recounted, indent=1, default=str))
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
