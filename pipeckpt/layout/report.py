"""The search's answer as a user reads it: a table of the top layouts and a picture of the
memory-time frontier.

Why apart from the search: ranking is one job, saying it another; the plan command prints this
table, train.py logs its first row, and the PNG shows what the table cannot, how much step time each
byte of device memory buys among every layout that fits.
"""

import sys
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from pipeckpt.layout.search import Ranked, Searched, why_lost
from pipeckpt.sizes import human

__all__ = ["modes_text", "format_row", "format_search", "frontier", "draw", "progress_printer"]


def modes_text(modes: Sequence[str]) -> str:
    """Per-stage modes, runs folded: ``never x3, always:1``."""
    out: List[str] = []
    run: List[str] = []
    for m in [*modes, None]:
        if run and m != run[-1]:
            out.append(run[0] if len(run) == 1 else f"{run[0]} x{len(run)}")
            run = []
        if m is not None:
            run.append(m)
    return ", ".join(out)


HEADER = (
    f"{'#':>2} {'layout':<48} {'schedule':<26} {'chunks':>6} {'peak/rank':>10} {'step ms':>9} "
    f"{'tok/s/dev':>10} {'MFU %':>6} {'bubble %':>8} {'comm %':>6}  modes"
)


def format_row(i: int, r: Ranked) -> str:
    """One layout's row of :data:`HEADER`."""
    c, e = r.candidate, r.estimate
    schedule = c.schedule + (f" (v{c.virtual_stages})" if c.virtual_stages > 1 else "")
    return (
        f"{i:>2} {c.describe():<48} {schedule:<26} {c.chunks:>6} {human(r.fitted.peak):>10} "
        f"{e.step_s * 1e3:>9.2f} {e.tokens_per_s_per_device:>10.0f} {100 * e.mfu:>6.1f} "
        f"{100 * r.bubble_share:>8.1f} {100 * r.comm_share:>6.1f}  {modes_text(c.modes)}"
    )


def pick_record(r: Ranked) -> Dict[str, Any]:
    """A layout and its predictions as a run's hyperparameters record them (plain values)."""
    c, e = r.candidate, r.estimate
    return {
        "layout": c.describe(),
        "schedule": c.schedule,
        "virtual_stages": c.virtual_stages,
        "chunks": c.chunks,
        "modes": modes_text(c.modes),
        "predicted_peak_bytes_per_rank": int(r.fitted.peak),
        "predicted_step_s": float(e.step_s),
        "predicted_tokens_per_s_per_device": float(e.tokens_per_s_per_device),
    }


def format_search(searched: Searched, *, top: int = 8, device: str = "") -> str:
    """The top layouts, why the runner-up lost, and what was dropped and why."""
    lines = [
        (
            f"layout search: {searched.considered} layouts considered"
            if searched.considered > 1
            else "layout checked"
        )
        + (
            f", the {len(searched.ranked)} fastest that fit"
            if searched.dropped_at("floor")
            else f", {len(searched.ranked)} fit"
        )
        + (f" {device}" if device else "")
        + f"; {searched.dropped_at('state')} dropped on parameters, gradients and optimizer state "
        f"alone, {searched.dropped_at('memory')} with every checkpoint mode"
        + (
            f", {searched.dropped_at('dominated')} reducing every micro-batch where reducing once "
            "fits without recompute"
            if searched.dropped_at("dominated")
            else ""
        )
        + (
            f", {searched.dropped_at('floor')} not fitted: slower than those whatever their modes"
            if searched.dropped_at("floor")
            else ""
        ),
        HEADER,
    ]
    lines += [format_row(i + 1, r) for i, r in enumerate(searched.ranked[:top])]
    if not searched.ranked:  # why the closest did not fit (a layout given by hand: why it does not)
        lines += [
            f"dropped: {d.candidate.describe()} {d.candidate.schedule}: {d.reason}"
            for d in searched.dropped[:3]
        ]
    if len(searched.ranked) >= 2:
        lines.append(why_lost(searched.ranked[1], searched.ranked[0]))
    return "\n".join(lines)


def frontier(ranked: Sequence[Ranked]) -> List[Ranked]:
    """The layouts no other beats on both peak and step time, by rising peak."""
    out: List[Ranked] = []
    for r in sorted(ranked, key=lambda r: (r.fitted.peak, r.estimate.step_s)):
        if not out or r.estimate.step_s < out[-1].estimate.step_s:
            out.append(r)
    return out


def draw(searched: Searched, path: str, device_bytes: int) -> None:
    """Every layout that fits as a point (per-rank peak, step time), coloured by schedule; the
    frontier as a line, the pick circled, the device's memory as a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max((r.fitted.peak for r in searched.ranked), default=device_bytes)
    gib, unit = (2**30, "GiB") if top >= 2**30 else (2**20, "MiB")  # the points' scale, not the device's
    fig, ax = plt.subplots(figsize=(8, 5))
    counts = Counter(r.candidate.schedule for r in searched.ranked)
    for schedule in sorted(counts):
        points: List[Tuple[float, float]] = [
            (r.fitted.peak / gib, r.estimate.step_s * 1e3)
            for r in searched.ranked
            if r.candidate.schedule == schedule
        ]
        ax.scatter(
            [p[0] for p in points], [p[1] for p in points], s=12, label=f"{schedule} ({counts[schedule]})"
        )
    edge = frontier(searched.ranked)
    ax.plot(
        [r.fitted.peak / gib for r in edge],
        [r.estimate.step_s * 1e3 for r in edge],
        color="black",
        lw=1,
        label="frontier",
    )
    if searched.ranked:
        best = searched.ranked[0]
        ax.scatter(
            [best.fitted.peak / gib],
            [best.estimate.step_s * 1e3],
            s=120,
            facecolors="none",
            edgecolors="red",
            label=f"pick: {best.candidate.describe()}",
        )
    if device_bytes <= 2 * top:  # else the line would squeeze every point against the axis
        ax.axvline(device_bytes / gib, color="grey", linestyle="--", label=f"device {human(device_bytes)}")
    ax.set_xlabel(f"predicted peak per rank ({unit}; the device holds {human(device_bytes)})")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("layouts that fit: memory-time frontier")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def progress_printer(
    every_s: float = 60.0, out: Optional[TextIO] = None, clock: Callable[[], float] = time.monotonic
) -> Callable[[int, int, int], None]:
    """A :func:`pipeckpt.layout.search.search` ``progress`` that writes one line at most every
    ``every_s`` seconds (to standard error): how many layouts are done and fit, so a search of a
    large world says how far it is, and a short one says nothing."""
    began = last = clock()

    def progress(done: int, total: int, fits: int) -> None:
        nonlocal last
        now = clock()
        if now - last >= every_s:
            last = now
            print(
                f"layout search: {done:,} of {total:,} layouts done, {fits:,} fit so far, "
                f"{now - began:.0f} s",
                file=out if out is not None else sys.stderr,
                flush=True,
            )

    return progress
