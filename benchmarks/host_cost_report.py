"""The host-cost benchmark's tables (``benchmarks/bench_host_cost.py``): the timed run's ratios per
part of a step, ``--calls``'s counts and ``--parts``'s per-part differences, from the rows the ranks
wrote.

Apart from the script because they only read rows and write Markdown: nothing here runs a rank.
"""

import math
import statistics
from typing import Any, Dict, List

from harness.machine import machine
from host_cost_methods import METHODS


def per_round(rows: List[Dict[str, Any]], rounds: int) -> List[Dict[str, Dict[str, float]]]:
    """Each round's step of each method: CPU and inner CPU summed over ranks, wall time the slower rank's."""
    out = []
    for r in range(rounds):
        by_method = {}
        for method in METHODS:
            mine = [row for row in rows if row["round"] == r and row["method"] == method]
            by_method[method] = {
                "cpu": sum(row["cpu"] for row in mine),
                "main": sum(row["main"] for row in mine),
                "sys": sum(row["sys"] for row in mine),
                "inner": sum(row["inner"] for row in mine),
                "wall": max(row["wall"] for row in mine),
                **{f"cpu{row['rank']}": row["cpu"] for row in mine},
            }
        out.append(by_method)
    return out


def report(
    spec: Dict[str, Any], rounds: List[Dict[str, Dict[str, float]]], loads: List[str], elapsed: float
) -> str:
    med = statistics.median

    def value(r: Dict[str, Dict[str, float]], method: str, key: str) -> float:
        if key == "rest":  # everything outside the schedule's part: loop, data, optimizer
            return r[method]["cpu"] - r[method]["inner"]
        return r[method][key]

    def ratio(key: str, num: str, den: str) -> float:
        pairs = [(value(r, num, key), value(r, den, key)) for r in rounds]
        # nan where a round measured nothing (a --quick run's kernel time can be 0)
        return med([a / b if b else math.nan for a, b in pairs])

    def row(name: str, key: str) -> str:
        ms = [f"{med([value(r, m, key) for r in rounds]) * 1e3:.2f}" for m in METHODS]
        ratios = [
            f"{ratio(key, 'pipeckpt', 'lightning'):.3f}",
            f"{ratio(key, 'pipeckpt', 'raw'):.3f}",
            f"{ratio(key, 'lightning', 'raw'):.3f}",
        ]
        return f"| {name} | {' | '.join(ms)} | {' | '.join(ratios)} |"

    def per_round_list(num: str, den: str) -> str:
        return " ".join(f"{r[num]['cpu'] / r[den]['cpu']:.3f}" for r in rounds)

    lines = [
        "## Host cost: the distributed engine against a hand-written pipelining script "
        "(`benchmarks/bench_host_cost.py`)",
        "",
        f"Machine: {machine()}. Load average (1/5/15 min) before and after the run: {loads[0]}; "
        f"{loads[1]}. Wall time of the run: {elapsed / 60:.1f} min.",
        f"Model: {spec['depth']} x `Linear({spec['width']}, {spec['width']})`, batch {spec['batch']}, "
        f"2 gloo processes of one torch thread, 2 stages of {spec['depth'] // 2}, 1F1B over "
        f"{spec['chunks']} micro-batches, AdamW, no activation checkpointing. Losses of every step "
        "and both ranks' final weights asserted equal to the raw script's to the bit, for every "
        f"method. Per step after {spec['warmup']} warm-up steps, mean of {spec['timed']} steps; "
        f"{len(rounds)} rounds, each method first in turn; medians of per-round ratios. CPU: "
        "process CPU time summed over both ranks; wall: the slower rank's. Methods: raw = the "
        "hand-written script; Lightning + raw = the same stage and schedule inside a Lightning "
        "`Trainer` (Lightning's loop around it, nothing else); pipeckpt = "
        '`PipelineStrategy(engine="distributed")`. Command: `python benchmarks/bench_host_cost.py'
        f"{' --quick' if spec['quick'] else ''}{' --pin' if spec.get('pin') else ''} --rounds {len(rounds)}`"
        f"{' (each rank pinned to a core of its own)' if spec.get('pin') else ''}.",
        "",
        "| part of a step | raw CPU ms | Lightning + raw CPU ms | pipeckpt CPU ms | "
        "**pipeckpt / (Lightning + raw)**: the engine's own cost | pipeckpt / raw | "
        "(Lightning + raw) / raw: Lightning's loop |",
        "|---|---|---|---|---|---|---|",
        row("whole step", "cpu"),
        row("schedule: `schedule.step` / the engine's `run` + `take_step_gradients`", "inner"),
        row("the rest: loop, data, optimizer", "rest"),
        row("main threads only (the rest is gloo's threads)", "main"),
        row("in the kernel (system CPU time)", "sys"),
        row("rank 0 (first stage), whole step", "cpu0"),
        row("rank 1 (last stage), whole step", "cpu1"),
        row("wall time per step", "wall"),
        "",
        "Whole-step CPU ratios of each round, in order (the spread is the machine's noise):",
        f"pipeckpt / (Lightning + raw): {per_round_list('pipeckpt', 'lightning')};",
        f"pipeckpt / raw: {per_round_list('pipeckpt', 'raw')};",
        f"(Lightning + raw) / raw: {per_round_list('lightning', 'raw')}.",
        "",
    ]
    return "\n".join(lines)


def report_calls(spec: Dict[str, Any], rows: List[Dict[str, Any]], elapsed: float) -> str:
    """``--calls``: each method's function calls per step on each rank, and their ratios."""
    calls = {(row["method"], row["rank"]): row["calls"] for row in rows}
    total = {m: calls[m, 0] + calls[m, 1] for m in METHODS}
    lines = [
        "## Host cost as a count: Python calls per step (`benchmarks/bench_host_cost.py --calls`)",
        "",
        f"Machine: {machine()}. Wall time of the run: {elapsed / 60:.1f} min. Same model, data and "
        f"methods as the timed run ({spec['depth']} x `Linear({spec['width']}, {spec['width']})`, batch "
        f"{spec['batch']}, 2 processes, 1F1B over {spec['chunks']} micro-batches); per step, the mean "
        f"over {spec['timed']} steps after {spec['warmup']} warm-up steps, of the Python and builtin "
        "function calls cProfile counts in each rank's main thread (a count, the same on every run; "
        "its timings are not used).",
        "",
        "| method | rank 0 (first stage) | rank 1 (last stage) | both | / raw | / (Lightning + raw) |",
        "|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        lines.append(
            f"| {m} | {calls[m, 0]:.0f} | {calls[m, 1]:.0f} | {total[m]:.0f} | "
            f"{total[m] / total['raw']:.3f} | {total[m] / total['lightning']:.3f} |"
        )
    return "\n".join([*lines, ""])


def report_parts(spec: Dict[str, Any], rows: List[Dict[str, Any]], elapsed: float) -> str:
    """``--parts``: per rank, each part's CPU ms per step under both runs and the median difference."""
    med = statistics.median
    names = [k for k in rows[0] if k not in ("round", "method", "rank")]
    lines = [
        "## Where a step's host time goes: Lightning + raw against pipeckpt, part by part "
        "(`benchmarks/bench_host_cost.py --parts`)",
        "",
        f"Machine: {machine()}. Wall time of the run: {elapsed / 60:.1f} min. Same model, data and "
        f"methods as the timed run ({spec['depth']} x `Linear({spec['width']}, {spec['width']})`, "
        f"batch {spec['batch']}, 2 processes, 1F1B over {spec['chunks']} micro-batches); the main "
        f"thread's CPU ms per step, mean of {spec['timed']} steps after {spec['warmup']} warm-up steps; "
        f"{spec['rounds']} rounds, which run goes first alternating; median over rounds, and the "
        "median of the per-round differences (pipeckpt - Lightning + raw), which is steadier.",
        "",
        "| part of a step | rank | Lightning + raw ms | pipeckpt ms | difference ms (median) | "
        "difference / Lightning + raw's step |",
        "|---|---|---|---|---|---|",
    ]
    rounds = range(spec["rounds"])
    # each rank's whole step under Lightning + raw, the denominator of every part's share
    light_rows = [x for x in rows if x["method"] == "lightning"]
    step = "whole step (main thread)"
    steps = {rank: med(x[step] for x in light_rows if x["rank"] == rank) for rank in (0, 1)}
    for name in names:
        for rank in (0, 1):
            mine = {(x["round"], x["method"]): x[name] for x in rows if x["rank"] == rank}
            light = med(mine[r, "lightning"] for r in rounds)
            piped = med(mine[r, "pipeckpt"] for r in rounds)
            diff = med(mine[r, "pipeckpt"] - mine[r, "lightning"] for r in rounds)
            share = diff / steps[rank]
            lines.append(
                f"| {name} | {rank} | {light * 1e3:.3f} | {piped * 1e3:.3f} "
                f"| {diff * 1e3:+.3f} | {share * 100:+.1f}% |"
            )
    return "\n".join([*lines, ""])
