"""The stage report's rows, as an aligned text table and as a bar chart.

The chart is drawn on a bare matplotlib ``Figure`` rather than through pyplot, so the caller's
backend stays as it was and no display is needed (cluster nodes have none).
"""

from dataclasses import dataclass
from pathlib import Path

from pipeckpt.sizes import MiB, human

__all__ = ["StageStats", "format_table", "save_chart"]


@dataclass(frozen=True)
class StageStats:
    """What the report says about one stage. Times are per training step.

    Args:
        stage: the stage's index.
        first_layer: its first layer's index in the pipeline Sequential.
        last_layer: its last layer's index.
        params: its parameters (elements).
        peak_activation_bytes: the peak of what its forwards and recomputes allocated.
        forward_s: its forward time per step.
        backward_s: its backward time per step, recomputes included.
        recomputed: the micro-batches it recomputed in backward per step.
        step_share: ``(forward_s + backward_s)`` over the step time.
        mode: its checkpoint mode.
    """

    stage: int
    first_layer: int
    last_layer: int
    params: int
    peak_activation_bytes: int
    forward_s: float
    backward_s: float  # includes the recompute of checkpointed micro-batches
    recomputed: int  # micro-batches recomputed in backward, per step
    step_share: float  # (forward_s + backward_s) / step time
    mode: str


def format_table(stats: list[StageStats]) -> str:
    """The report as an aligned text table, one line per stage.

    Args:
        stats: the report's rows.
    """
    header = (
        "stage",
        "layers",
        "params",
        "peak activations",
        "fwd ms",
        "bwd ms",
        "recomputed",
        "step share",
        "checkpoint",
    )
    rows = [
        (
            str(s.stage),
            f"{s.first_layer}-{s.last_layer}",
            f"{s.params:,}",
            human(s.peak_activation_bytes),
            f"{1e3 * s.forward_s:.1f}",
            f"{1e3 * s.backward_s:.1f}",
            f"{s.recomputed} mb",
            f"{100 * s.step_share:.0f}%",
            s.mode,
        )
        for s in stats
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = range(2, 8)  # right-aligned columns

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def save_chart(stats: list[StageStats], path: Path) -> None:
    """Two bar charts side by side: activation memory, and forward / backward time.

    Args:
        stats: the report's rows.
        path: the image file to write.
    """
    from matplotlib.figure import Figure

    labels = [f"{s.stage}\n{s.mode}" for s in stats]
    x = range(len(stats))
    fig = Figure(figsize=(4 + 1.2 * len(stats), 3.6))
    mem, tim = fig.subplots(1, 2)
    mem.bar(x, [s.peak_activation_bytes / MiB for s in stats], color="tab:blue")
    mem.set_title("peak activation memory")
    mem.set_ylabel("MiB")
    fwd = [1e3 * s.forward_s for s in stats]
    bwd = [1e3 * s.backward_s for s in stats]
    tim.bar(x, fwd, label="forward", color="tab:green")
    tim.bar(x, bwd, bottom=fwd, label="backward + recompute", color="tab:red")
    for i, s in enumerate(stats):
        tim.text(
            i, fwd[i] + bwd[i], f"{s.step_share:.0%} of step", ha="center", va="bottom", fontsize="x-small"
        )
    tim.set_title("time per step")
    tim.set_ylabel("ms")
    tim.set_ylim(top=1.35 * max([f + b for f, b in zip(fwd, bwd)] + [1e-3]))  # room for labels and legend
    tim.legend(fontsize="x-small", loc="upper center", ncols=2)
    for ax in (mem, tim):
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("stage / checkpoint mode")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
