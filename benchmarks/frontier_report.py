"""The report of benchmarks/bench_frontier.py: the Markdown tables (each peer's point, the pipeckpt
candidates at or below it, auto's picks; every candidate measured beside the model's prediction, and the
rank correlation of predicted and measured step time) and the PNG of the same points.

Apart from the script because it is the other half of the work: the script decides what is measured
and how (the candidates, auto's budget at each peer, the timing), this only lays out the figures the
script hands it; nothing here measures or plans.
"""

import statistics
from pathlib import Path
from typing import List, Sequence, Tuple

from bench_checkpoint import Config, Method
from harness.machine import machine

from pipeckpt.memory.auto import DEFAULT_MODES
from pipeckpt.sizes import MiB


def _point(m: Method) -> Tuple[float, float]:
    return m.footprint_mib or 0.0, statistics.median(m.cpu_ratios)


def _spread(m: Method) -> str:
    return f"{min(m.cpu_ratios):.2f}-{max(m.cpu_ratios):.2f}"


def _step_ms(m: Method, repeat: int) -> float:
    return statistics.median(m.cpu) / repeat * 1e3


def _ranks(values: Sequence[float]) -> List[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def _spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Rank correlation, hand-written: five lines against a SciPy import the project does not need."""
    n = len(a)
    if n < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    return 1 - 6 * sum((p - q) ** 2 for p, q in zip(ra, rb)) / (n * (n * n - 1))


def table(
    by_key,
    peers,
    candidates,
    predicted,
    autos,
    cfg: Config,
    rounds: int,
    repeat: int,
    headrooms: Sequence[float],
) -> List[str]:
    plain = by_key["plain"]
    plain_ms = [c / repeat * 1e3 for c in plain.cpu]
    lines = [
        f"# Frontier: peak activations + gradients (MiB) and CPU time vs plain ({rounds} interleaved rounds "
        f"of {repeat} steps per sample; medians, round-to-round range in brackets)",
        f"{machine()}; GPT d {cfg.d_model} x {cfg.n_layers}, vocab {cfg.vocab_size}, seq {cfg.seq_len}, "
        f"batch {cfg.batch}, {cfg.stages} stages; pipeckpt candidates: modes "
        f"{[m.name for m in DEFAULT_MODES]} on every stage x chunks {sorted({c for _, c, _ in candidates})}; "
        f"plain step {statistics.median(plain_ms):.2f} ms CPU "
        f"(range {min(plain_ms):.2f}-{max(plain_ms):.2f})",
        "auto's budget at a peer: its figure (to the byte, then less a headroom for the model's error) plus "
        "the parameters (SGD: no state); `choose(..., shared_device=True, balances=pipeckpt.memory.budget."
        "balance_candidates(...))`, as `memory.search=[balance]` searches; each pick measured. Candidates "
        "besides the uniform "
        "modes: auto's picks, and plans shaped like per-block checkpointing (embedding alone, first blocks "
        "per layer)",
        "",
        "| peer | peak act+grad MiB | time vs plain [range] | pipeckpt at or below on both (medians) | "
        + " | ".join(f"auto, budget {_budget_name(h)}: pick (MiB, time [range])" for h in headrooms)
        + " |",
        "|---|---|---|---|" + "---|" * len(headrooms),
    ]
    for peer in peers:
        pm, pt = _point(by_key[peer])
        below = [m for m in candidates.values() if _point(m)[0] <= pm and _point(m)[1] <= pt]
        names = ", ".join(f"{m.label} ({_point(m)[0]:.2f}, {_point(m)[1]:.2f})" for m in below) or "none"
        picks = []
        for h in headrooms:
            auto = autos.get((peer, h))
            if auto is None:
                picks.append("no plan fits")
                continue
            m = candidates[auto]
            am, at = _point(m)
            verdict = "at or below" if am <= pm and at <= pt else "not below"
            if am > pm:
                verdict += f" (+{(am - pm) * MiB:.0f} B)"
            picks.append(f"{m.label}: **{verdict}** ({am:.2f}, {at:.2f} [{_spread(m)}])")
        lines.append(
            f"| {by_key[peer].label} | {pm:.2f} | {pt:.2f} [{_spread(by_key[peer])}] | {names} | "
            + " | ".join(picks)
            + " |"
        )
    lines += [
        "",
        "Candidates, measured against the model (predicted process peak: `pipeckpt.memory.auto.process_peak` "
        "less the parameters; predicted step: `predict(..., shared_device=True)` from the profile):",
        "",
        "| pipeckpt candidate | peak MiB measured / predicted | time vs plain [range] "
        "| step ms CPU measured / predicted |",
        "|---|---|---|---|",
    ]
    for key, m in candidates.items():
        p = predicted[key]
        lines.append(
            f"| {m.label} | {_point(m)[0]:.2f} / {p.process_mib:.2f} | {_point(m)[1]:.2f} [{_spread(m)}] "
            f"| {_step_ms(m, repeat):.2f} / {p.step_ms:.2f} |"
        )
    keys = list(candidates)
    rho = _spearman([_step_ms(candidates[k], repeat) for k in keys], [predicted[k].step_ms for k in keys])
    lines += [
        "",
        f"Rank correlation (Spearman) of predicted and measured step time over the candidates: {rho:.2f}",
    ]
    return lines


def _budget_name(headroom: float) -> str:
    return "to the byte" if headroom == 0 else f"less {headroom:.1%}"


def draw(by_key, peers, candidates, autos, path: Path) -> None:
    """Peers, every candidate, auto's picks; labels only on peers, picks and the candidates no other
    candidate beats on both axes (the rest would be unreadable)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5))
    ax = fig.subplots()

    def point(m: Method, **style) -> None:
        mm, t = _point(m)
        err = [[t - min(m.cpu_ratios)], [max(m.cpu_ratios) - t]]
        ax.errorbar([mm], [t], yerr=err, capsize=2, linestyle="none", **style)

    chosen = {k for k in autos.values() if k is not None}
    points = {k: _point(m) for k, m in candidates.items()}
    frontier = {
        k
        for k, (mm, t) in points.items()
        if not any(o != (mm, t) and o[0] <= mm and o[1] <= t for o in points.values())
    }
    for key in peers:
        point(by_key[key], marker="s", color="tab:red", markersize=7)
        ax.annotate(
            key,
            _point(by_key[key]),
            fontsize="small",
            color="tab:red",
            xytext=(4, 4),
            textcoords="offset points",
        )
    for key, m in candidates.items():
        picked = key in chosen
        point(
            m,
            marker="*" if picked else "o",
            color="tab:green" if picked else "tab:blue",
            markersize=9 if picked else 4,
        )
        if picked or key in frontier:
            ax.annotate(
                m.key.replace("pipeckpt-", ""),
                _point(m),
                fontsize="xx-small",
                color="tab:green" if picked else "tab:blue",
                xytext=(4, -8),
                textcoords="offset points",
            )
    ax.set_yscale("log")
    ax.set_xlabel("peak activations + gradients, MiB")
    ax.set_ylabel("CPU time vs plain (median; bars: round-to-round range)")
    ax.set_title(
        "frontier: peers (red), pipeckpt candidates (blue; labelled: not beaten on both), auto (green)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
