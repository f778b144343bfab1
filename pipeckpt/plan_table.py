"""The plan command's output for one device per stage: the table of each stage's memory and time,
and the picture of the same (stacked bars against the budget).

Why apart from :mod:`pipeckpt.plan`: printing and drawing a prediction is one job, composing the
configs and building and profiling the model another; the per-rank table of a sharded layout has its
own format (:func:`pipeckpt.memory.sharding.format_ranks`).
"""

from typing import Optional

from pipeckpt.memory.predict import Prediction
from pipeckpt.sizes import MiB

__all__ = ["COLUMNS", "format_prediction", "draw", "mib"]


def mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


COLUMNS = ("params", "grads", "optimizer", "activations", "boundary", "working")


def format_prediction(prediction: Prediction, budget: Optional[int] = None) -> str:
    """One row per stage (MiB, and milliseconds of the stage's own compute per step)."""
    header = (
        f"{'stage':>5} {'layers':>7} {'mode':>11} "
        + " ".join(f"{c:>11}" for c in COLUMNS)
        + f" {'peak':>9} {'in-flight':>9} {'recomp':>6} {'time ms':>8}  peak at"
    )
    lines = [
        f"schedule {prediction.schedule} ({prediction.order_source}), chunks {prediction.chunks}; "
        "MiB per stage",
        header,
    ]
    for s in prediction.stages:
        mark = "" if budget is None else ("  fits" if s.peak <= budget else "  OVER BUDGET")
        lines.append(
            f"{s.stage:>5} {f'{s.layers[0]}-{s.layers[1] - 1}':>7} {s.mode:>11} "
            + " ".join(f"{getattr(s, c) / MiB:>11.2f}" for c in COLUMNS)
            + f" {s.peak / MiB:>9.2f} {s.in_flight:>9} {s.recomputed:>6} {s.time_s * 1e3:>8.1f}"
            + f"  {s.peak_at}{mark}"
        )
    lines.append(f"predicted step time: {prediction.step_time_s * 1e3:.1f} ms (one device per stage)")
    return "\n".join(lines)


def draw(prediction: Prediction, path: str, budget: Optional[int] = None) -> None:
    """Stacked bars per stage (the peak's parts), the budget as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(prediction.stages), 4))
    x = [s.stage for s in prediction.stages]
    bottom = [0.0] * len(x)
    for column in COLUMNS:
        values = [getattr(s, column) / MiB for s in prediction.stages]
        ax.bar(x, values, bottom=bottom, label=column)
        bottom = [b + v for b, v in zip(bottom, values)]
    if budget is not None:
        ax.axhline(budget / MiB, color="black", linestyle="--", label=f"budget {mib(budget)}")
    ax.set_xticks(x, [f"{s.stage}\n{s.mode}" for s in prediction.stages])
    ax.set_xlabel("stage")
    ax.set_ylabel("MiB at the stage's peak")
    ax.set_title(f"predicted memory per stage ({prediction.schedule}, chunks {prediction.chunks})")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
