"""Some layouts of a saved measured run (``bench_layout_measured.py --save``) trained again, to see
how a change to the engine moved their measured steps: the same model, world, batch and harness
(``harness.layout_fit``), the named rows only, rounds interleaved as the full run interleaves them.

Reported per row: the median over rounds of its slowest rank's seconds per step now, the saved
measurement, and their ratio; and each row's step over the fastest's, now and then.

    python benchmarks/bench_layout_remeasure.py benchmarks/layout_measured_llama4_2026-12-02.json \\
        "pp4 x tp1 x dp1 1f1b x8" "pp2 x tp1 x dp2 gpipe x2" --rounds 5
"""

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List

from bench_layout_measured import __file__ as measured_script
from harness.machine import machine
from harness.ranks import run_ranks


def remeasure(saved: Dict[str, Any], names: List[str], rounds: int, timeout: int) -> List[str]:
    lines = [f"On {machine()}.", ""]
    for run in saved["runs"]:
        rows = [r for r in run["rows"] if r["layout"] in names]
        if not rows:
            continue
        spec = {"overrides": run["overrides"], "rows": rows, **saved["args"], "rounds": rounds}
        results = run_ranks(measured_script, run["world"], spec, timeout=timeout)
        now = []
        for i in range(len(rows)):
            mine = [x for x in results if x["row"] == i]
            now.append(
                statistics.median(max(x["seconds"] for x in mine if x["round"] == r) for r in range(rounds))
            )
        best_now, best_then = min(now), min(r["measured_s"] for r in rows)
        lines += [
            f"{run['name']} on {run['world']} processes, {rounds} rounds (saved: {saved['when']})",
            "",
            "| layout | now ms | saved ms | now / saved | over the fastest now | then |",
            "|---|---|---|---|---|---|",
        ]
        for row, s in zip(rows, now):
            then = row["measured_s"]
            lines.append(
                f"| {row['layout']} | {s * 1e3:.0f} | {then * 1e3:.0f} | {s / then:.2f} "
                f"| {s / best_now:.2f} | {then / best_then:.2f} |"
            )
        lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("saved", help="a bench_layout_measured.py --save JSON")
    parser.add_argument("layouts", nargs="+", help="rows by their layout column")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--out", default="/dev/stdout")
    args = parser.parse_args()
    saved = json.loads(Path(args.saved).read_text())
    lines = remeasure(saved, args.layouts, args.rounds, args.timeout)
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
