"""The layout search's predictions against measured steps on this machine (issue 44, item 5).

For each model (the app's GPT, an HF Llama built from a config) and world (2 and 4 gloo processes of
one torch thread each), the search (``strategy.layout=auto cluster=local``, as ``python -m
pipeckpt.plan`` runs it) ranks every layout it finds; this benchmark then trains, through a real
``Trainer`` with the app's own model, data and strategy, every feasible layout of GPipe and 1F1B at two
chunk counts each (the least the schedule takes and twice that; one stage's pipeline runs GPipe only),
and the search's own pick when it is another. Each layout's fit is warm-up steps, timed steps, and
one more step counted by :class:`harness.live_bytes.LiveBytes` (every storage alive: parameters,
gradients, optimizer state, the batch, what the step creates), the DTensors' local shards for
FSDP and tensor parallelism; with ``--allocated``, by the CPU allocator too, which also sees the
local tensors DTensor makes inside an operator (:mod:`harness.allocated_bytes`), and the
predicted peaks are held to that.

The ranks are started once (:func:`harness.ranks.run_ranks`) and fit every layout in turn, rounds
interleaved (each round in another order), so the layouts share the machine's state alike. A
layout's measured step is the median over rounds of its slowest rank's seconds per step; its
measured peak per pipeline rank is the most any of that rank's replicas held.

Reported per world: predicted against measured step time (Spearman's rank correlation), the pick's
measured time against the measured best, and each layout's predicted peak against the measured
one. The ``cluster=local`` figures are measured afresh at the start (unless ``--no-calibrate``, which
reads the user's cached ones), so they are the quiet machine's; ``--repredict`` predicts with the
saved run's figures, so the new predictions use the machine as it was measured. Either way they are
kept in a cache directory of the run's own, removed at its end: the user's cached figures are
neither replaced nor deleted.

Command::

    python benchmarks/bench_layout_measured.py --save run.json --out results.md   # ~75 min on 2 cores
    python benchmarks/bench_layout_measured.py --allocated ...   # peaks by the CPU allocator too
    python benchmarks/bench_layout_measured.py --repredict run.json           # the same runs, predicted anew
    python benchmarks/bench_layout_measured.py --quick       # a tiny GPT, 2 processes: checks the harness
"""

import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from harness.machine import machine
from harness.ranks import ranks_arguments, run_ranks
from harness.spearman import spearman

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("gpipe", "1f1b")
LLAMA = (
    "model.config={model_type:llama,hidden_size:256,intermediate_size:688,num_hidden_layers:8,"
    "num_attention_heads:8,num_key_value_heads:4,vocab_size:4096}"
)
CASES: Dict[str, List[str]] = {
    "gpt": ["model=gpt", "model.size=mini"],
    "llama": ["model=hf", LLAMA, "data.max_bytes=400000"],
    # the same Llama with sequence parallelism: only its tensor-parallel layouts differ (--split)
    "llama_sp": ["model=hf", LLAMA, "data.max_bytes=400000", "strategy.sequence_parallel=true"],
}
QUICK: Dict[str, List[str]] = {"gpt": ["model=gpt", "model.size=tiny"]}


def overrides(case: Sequence[str], world: int, batch: int) -> List[str]:
    """The app's overrides of one search: the model, the distributed engine on ``world`` processes
    of this machine, the global batch."""
    return [
        *case,
        "strategy.engine=distributed",
        "strategy.layout=auto",
        "cluster=local",
        "trainer.accelerator=cpu",
        f"trainer.devices={world}",
        f"data.batch_size={batch}",
        "threads=1",
    ]


def _compose(args: Sequence[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from pipeckpt.app.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(args))


def chosen(ranked: Sequence[Any], which: str = "default") -> List[Any]:
    """The measured layouts of a search's ranked rows: GPipe and 1F1B at the least chunk count each
    takes and twice that, the search's pick besides; ``which="per_schedule"``: instead the
    best-ranked layout of every schedule the search ranked (the looped and zero-bubble ones among
    them); ``"all"``: every row (a saved run predicted again keeps those it measured); ``"split"``:
    the default's rows with tensor parallelism."""
    if which == "all":
        return list(ranked)
    if which == "split":
        return [r for r in chosen(ranked) if r.candidate.tp > 1]
    if which == "per_schedule":
        schedules = dict.fromkeys(r.candidate.schedule for r in ranked)
        return [next(r for r in ranked if r.candidate.schedule == s) for s in schedules]
    out = []
    for r in ranked:
        c = r.candidate
        if c.schedule not in SCHEDULES:
            continue
        alike = sorted({x.candidate.chunks for x in ranked if _same_but_chunks(x.candidate, c)})
        wanted = {alike[0], 2 * alike[0]}
        if c.chunks in wanted:
            out.append(r)
    if ranked and ranked[0] not in out:
        out.append(ranked[0])
    return out


def _same_but_chunks(a: Any, b: Any) -> bool:
    return (a.pp, a.tp, a.dp_replicate, a.dp_shard, a.schedule, a.virtual_stages) == (
        b.pp,
        b.tp,
        b.dp_replicate,
        b.dp_shard,
        b.schedule,
        b.virtual_stages,
    )


def searched(args: List[str], which: str = "default") -> Tuple[Any, List[Dict[str, Any]]]:
    """The search's answer and the measured layouts' rows: the pick's settings as train.py hands
    them on, the predicted step and per-rank peaks."""
    from pipeckpt.app.checks import check_config
    from pipeckpt.layout.report import format_row
    from pipeckpt.plan_layout import search_config

    cfg = _compose(args)
    check_config(cfg)
    answer = search_config(cfg)
    rows = []
    for r in chosen(answer.searched.ranked, which):
        c = r.candidate
        rows.append(
            {
                "layout": _named(c),
                "pick": {"settings": c.settings(), "dp": c.dp, "row": format_row(1, r)},
                "pp": c.pp,
                "predicted_s": r.estimate.step_s,
                "predicted_peaks": list(r.fitted.peaks),
                "rank": answer.searched.ranked.index(r) + 1,
                "modes": list(c.modes),
            }
        )
    return answer, rows


def worker(spec_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    from harness.layout_fit import fit_layout

    out: List[Dict[str, Any]] = []
    rows = spec["rows"]
    for r in range(spec["rounds"]):
        order = list(range(len(rows)))
        order = order[r % len(order) :] + order[: r % len(order)] if r % 2 == 0 else order[::-1]
        for i in order:
            fit = fit_layout(spec, rows[i])
            out.append({"round": r, "row": i, **fit._asdict()})
    with open(os.path.join(spec["out"], f"rank{os.environ['LOCAL_RANK']}.json"), "w") as f:
        json.dump(out, f)


def measured(results: List[Dict[str, Any]], rows: List[Dict[str, Any]], rounds: int) -> None:
    """Each row's measured seconds (median over rounds of the slowest rank) and peaks per pipeline rank."""
    for i, row in enumerate(rows):
        mine = [x for x in results if x["row"] == i]
        per_round = [max(x["seconds"] for x in mine if x["round"] == r) for r in range(rounds)]
        row["measured_s"] = statistics.median(per_round)
        row["rounds_s"] = per_round
        for key, name in (("peak", "measured_peaks"), ("allocated", "allocated_peaks")):
            peaks = [0] * row["pp"]
            for x in mine:
                peaks[x["pp_rank"]] = max(peaks[x["pp_rank"]], x.get(key) or 0)
            if any(peaks):
                row[name] = peaks


def _key(row: Dict[str, Any]) -> Tuple[str, int]:
    """A row's layout as a re-prediction matches it: its name and its stage count (the name of a
    looped layout does not say its stages per rank). Sequence parallelism's ``(sp)`` is left out: the
    runs saved before the name said it (2026-12-05) are matched too."""
    return row["layout"].replace(" (sp)", ""), len(row["modes"])


def _shown(row: Dict[str, Any]) -> str:
    """A row's layout as the tables show it: a looped one with its stages per rank."""
    v = len(row["modes"]) // row["pp"]
    head, chunks = row["layout"].rsplit(" x", 1)
    return f"{head} (v{v}) x{chunks}" if v > 1 else row["layout"]


def _named(c: Any) -> str:
    """A layout as the tables name it: degrees, schedule, micro-batches."""
    return f"{c.describe()} {c.schedule} x{c.chunks}"


def _held(row: Dict[str, Any]) -> List[int]:
    """The peaks a row's predictions are held against: the CPU allocator's where it was counted
    (``bench_layout_remeasure.py --allocated``: inside DTensor's operators too), else the operator
    count's."""
    peaks: List[int] = row.get("allocated_peaks") or row["measured_peaks"]
    return peaks


def table(name: str, world: int, answer: Any, rows: List[Dict[str, Any]], took: float) -> List[str]:
    mib = 2**20
    allocated = all("allocated_peaks" in r for r in rows)
    # a saved run predicted again may rank first a layout it did not measure: the best-ranked measured
    # one stands for the pick, and the line says so
    pick = min(rows, key=lambda r: r["rank"])
    best = min(rows, key=lambda r: r["measured_s"])
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    errors = [(p - m) / m for r in rows for p, m in zip(r["predicted_peaks"], _held(r)) if m > 0]
    within = sum(abs(e) <= 0.10 for e in errors)
    said = (
        f"- the search's pick ({_shown(pick)}) measured {pick['measured_s'] * 1e3:.0f} ms, "
        if pick["rank"] == 1
        else f"- the search's pick ({_named(answer.searched.best.candidate)}, rank 1) was not "
        f"measured in this run; its best-ranked measured layout ({_shown(pick)}, rank "
        f"{pick['rank']}) measured {pick['measured_s'] * 1e3:.0f} ms, "
    )
    lines = [
        f"### {name}, {world} processes ({len(rows)} layouts measured of {len(answer.searched.ranked)} "
        f"that fit; {took:.0f} s)",
        "",
        "| search rank | layout | modes | predicted ms | measured ms (rounds) | predicted / measured "
        "| predicted peak MiB per pp rank | measured peak MiB | peak error |"
        + (" operator count MiB |" if allocated else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if allocated else ""),
    ]
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        rounds = " ".join(f"{s * 1e3:.0f}" for s in r["rounds_s"])
        errs = [(p - m) / m for p, m in zip(r["predicted_peaks"], _held(r)) if m > 0]
        counted = f" {' / '.join(f'{m / mib:.1f}' for m in r['measured_peaks'])} |" if allocated else ""
        lines.append(
            f"| {r['rank']} | {_shown(r)} | {','.join(r['modes']) or 'never'} "
            f"| {r['predicted_s'] * 1e3:.0f} "
            f"| {r['measured_s'] * 1e3:.0f} ({rounds}) | {r['predicted_s'] / r['measured_s']:.2f} "
            f"| {' / '.join(f'{p / mib:.1f}' for p in r['predicted_peaks'])} "
            f"| {' / '.join(f'{m / mib:.1f}' for m in _held(r))} "
            f"| {' / '.join(f'{100 * e:+.1f}%' for e in errs)} |" + counted
        )
    lines += [
        "",
        f"- Spearman rank correlation, predicted vs measured step time: **{rho:.2f}** (bar: >= 0.8)",
        said + f"**{pick['measured_s'] / best['measured_s']:.2f}x** the measured best ({_shown(best)}, "
        f"{best['measured_s'] * 1e3:.0f} ms; bar: <= 1.10x)",
        f"- per-rank peaks within 10%{' (held: by the CPU allocator)' if allocated else ''}: "
        f"**{within} of {len(errors)}** (errors "
        f"{100 * min(errors):+.1f}% to {100 * max(errors):+.1f}%)",
        "",
    ]
    return lines


def repredicted(saved: Dict[str, Any]) -> Tuple[Any, List[Dict[str, Any]]]:
    """A saved measurement's rows with the search's predictions made now (the cost model may have
    changed since): matched by layout; a pick the run did not measure is said."""
    answer, rows = searched(saved["overrides"], "all")
    by_layout = {_key(r): r for r in saved["rows"]}
    kept = []
    for row in rows:
        old = by_layout.get(_key(row))
        if old is None:
            continue
        measured = ("measured_s", "rounds_s", "measured_peaks", "allocated_peaks")
        kept.append({**row, **{k: old[k] for k in measured if k in old}})
    return answer, kept


def _header(figures: Dict[str, Any], args: Any, when: str) -> List[str]:
    return [
        f"Measured on {machine()}, {when}; `cluster=local`: {figures['matmul_flops'] / 1e9:.1f} GFLOP/s "
        f"one-thread matmul, AdamW at {figures['memory_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"gloo {figures['gloo_bytes_per_s'] / 1e9:.2f} GB/s and {figures['gloo_latency_s'] * 1e6:.0f} us "
        f"(all-gather x{figures['gloo_all_gather_factor']:.2f}, reduce-scatter "
        f"x{figures['gloo_reduce_scatter_factor']:.2f} the ring rule); global batch {args.batch}, "
        f"{args.warmup} warm-up + {args.timed} timed steps, {args.rounds} rounds.",
        "",
    ]


def _own_cache() -> None:
    """Points ``cluster=local``'s cache (``$XDG_CACHE_HOME``, which the ranks inherit) at a directory
    of this run's own, removed when it ends: the figures it measures or restores never replace the
    ones the user's own searches cached."""
    own = tempfile.mkdtemp(prefix="bench-layout-measured-")
    atexit.register(shutil.rmtree, own, ignore_errors=True)
    os.environ["XDG_CACHE_HOME"] = own


def main() -> None:
    parser = ranks_arguments(__doc__.splitlines()[0], out="/dev/stdout", rounds=3, batch=16)
    parser.set_defaults(timeout=3000)  # one world's ranks: Llama on 4 processes takes ~35 min on 2 cores
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--no-calibrate", action="store_true", help="keep the cached cluster=local figures")
    parser.add_argument("--save", help="also write the measurements to this JSON file")
    parser.add_argument("--repredict", help="predict a saved JSON measurement again, measuring nothing")
    parser.add_argument(
        "--per-schedule", action="store_true", help="measure the best-ranked layout of every schedule instead"
    )
    parser.add_argument("--split", action="store_true", help="measure only the default rows with tp > 1")
    parser.add_argument(
        "--allocated",
        action="store_true",
        help="count each peak by the CPU allocator too (harness.allocated_bytes); predictions held to it",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from pipeckpt.layout.calibrate import cache_file
    from pipeckpt.layout.calibrate import measured as calibration

    if args.repredict or not args.no_calibrate:
        _own_cache()
    if args.repredict:
        saved = json.loads(Path(args.repredict).read_text())
        cache_file().parent.mkdir(parents=True, exist_ok=True)
        cache_file().write_text(json.dumps(saved["figures"]))  # the figures of the measured run
        vars(args).update(saved["args"])
        lines = _header(saved["figures"], args, saved["when"] + " (predicted again " + _now() + ")")
        for entry in saved["runs"]:
            answer, rows = repredicted(entry)
            lines += table(entry["name"], entry["world"], answer, rows, entry["seconds"])
    else:
        figures = calibration()  # measured afresh into the run's own cache, unless --no-calibrate
        cases = QUICK if args.quick else {k: CASES[k] for k in args.models.split(",")}
        worlds = [2] if args.quick else [int(w) for w in args.worlds.split(",")]
        kept = {
            k: vars(args)[k]
            for k in ("batch", "warmup", "timed", "rounds", "per_schedule", "split", "allocated")
        }
        saved = {"figures": figures, "when": _now(), "args": kept, "runs": []}
        lines = _header(figures, args, saved["when"])
        for name, case in cases.items():
            for world in worlds:
                began = time.time()
                over = overrides(case, world, args.batch)
                which = "per_schedule" if args.per_schedule else "split" if args.split else "default"
                answer, rows = searched(over, which)
                print(answer.text(top=5), flush=True)
                spec = {"overrides": over, "rows": rows, **kept}
                results = run_ranks(__file__, world, spec, timeout=args.timeout)
                measured(results, rows, args.rounds)
                took = time.time() - began
                saved["runs"].append(
                    {"name": name, "world": world, "overrides": over, "rows": rows, "seconds": took}
                )
                lines += table(name, world, answer, rows, took)
                print("\n".join(lines[-len(rows) - 10 :]), flush=True)
                if args.save:
                    Path(args.save).write_text(json.dumps(saved, indent=1, default=str))
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


if __name__ == "__main__":
    sys.exit(main())
