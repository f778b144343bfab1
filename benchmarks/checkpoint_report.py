"""The checkpoint benchmark's Markdown report: the results, per-round, gradient-accumulation and
targets tables, and the page around them.

Only formats what the measuring left on each :class:`checkpoint_methods.Method` and in the
:class:`checkpoint_measure.Checks`; it measures nothing. Apart so that the wording of the results
page can change without touching how it is measured.
"""

import math
import statistics
from typing import List, Optional, Sequence, Tuple

from checkpoint_measure import Checks
from checkpoint_methods import QUICK, Config, Method
from harness.machine import machine

from pipeckpt.sizes import MiB


def fmt(value: Optional[float], digits: int = 2) -> str:
    return "n/m" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def results_table(methods: List[Method]) -> List[str]:
    by_key = {m.key: m for m in methods}
    never = {
        "plain": "plain",
        "torch": "plain",
        "torchgpipe": "torchgpipe-never",
        "pipeckpt": "pipeckpt-never",
    }
    rows = [
        "| method | held after fwd MiB | peak MiB | peak, MemTracker categories MiB "
        "| step s wall / CPU | vs plain, CPU | vs plain, wall | peak vs never "
        "| vs peer: CPU time / peak |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        base = by_key[never[m.family]]
        vs_peer = "; ".join(
            f"{fmt(_ratio(median(m.cpu_ratios), median(by_key[p].cpu_ratios)))} / "
            f"{fmt(_ratio(m.peak_mib, by_key[p].peak_mib))} ({p})"
            for p in m.peers
        )
        rows.append(
            f"| {m.label} | {fmt(m.held_mib, 1)} | {fmt(m.peak_mib, 1)} "
            f"| {fmt(m.categories_mib, 1)} | {fmt(median(m.wall))} / {fmt(median(m.cpu))} "
            f"| {fmt(median(m.cpu_ratios))} | {fmt(median(m.wall_ratios))} "
            f"| {fmt(_ratio(m.peak_mib, base.peak_mib))} | {vs_peer} |"
        )
    return rows


def rounds_table(methods: List[Method]) -> List[str]:
    rows = ["| method | CPU-time ratio to plain, per round | wall-clock ratio, per round |", "|---|---|---|"]
    for m in methods[1:]:
        rows.append(
            f"| {m.label} | {' '.join(f'{r:.2f}' for r in m.cpu_ratios)} "
            f"| {' '.join(f'{r:.2f}' for r in m.wall_ratios)} |"
        )
    return rows


def accumulating_table(methods: List[Method]) -> List[str]:
    rows = [
        "| method | peak activations + gradients MiB, `.grad` empty "
        "| same, `.grad` already holding gradients |",
        "|---|---|---|",
    ]
    for m in methods:
        if m.accumulating_mib is not None:
            rows.append(f"| {m.label} | {fmt(m.footprint_mib, 1)} | {fmt(m.accumulating_mib, 1)} |")
    return rows


def targets(methods: List[Method], cfg: Config) -> List[str]:
    k = {m.key: m for m in methods}
    never, always = k["pipeckpt-never"], k["pipeckpt-always"]

    def cpu(key: str) -> float:
        return median(k[key].cpu_ratios)

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    lines = []
    for clock in ("cpu", "wall"):
        overhead = median(getattr(never, f"{clock}_ratios"))
        recompute = median(getattr(always, f"{clock}_ratios")) / overhead
        lines.append(
            f"- {'CPU' if clock == 'cpu' else 'Wall-clock'} time: pipeline overhead (pipeckpt "
            f"never vs plain) {overhead:.2f}x, target <= 1.05: {verdict(overhead <= 1.05)}; "
            f"always vs never {recompute:.2f}x, target <= 1.25: {verdict(recompute <= 1.25)}."
        )
    for attr, what in (
        ("peak_mib", "weight gradients being summed counted as gradients"),
        ("categories_mib", "MemTracker categories"),
    ):
        ours, theirs = getattr(always, attr), getattr(k["torchgpipe-always"], attr)
        lines.append(
            f"- Peak of pipeckpt always vs torchgpipe always ({what}): {fmt(ours, 1)} "
            f"vs {fmt(theirs, 1)} MiB, target no higher: {verdict(ours <= theirs)}."
        )
    rows = cfg.batch // cfg.chunks * cfg.seq_len
    over_loop = cpu("pipeckpt-never") / cpu("loop")
    lines += [
        "",
        "Why, in CPU time:",
        "",
        f"- The micro-batch floor: the plain loop over {cfg.chunks} micro-batches costs "
        f"{cpu('loop'):.2f}x plain (matrix products of {rows} rows instead of "
        f"{rows * cfg.chunks}), and pipeckpt never costs {over_loop:.2f}x the loop: "
        + (
            "the schedule, worker thread and queues add nothing beyond the noise (+-0.05), so "
            "what exceeds 1.05 is the cost of micro-batching itself on one device."
            if abs(over_loop - 1) <= 0.05
            else f"the schedule, worker thread and queues add {over_loop - 1:+.0%} to micro-batching."
        ),
        f"- always recomputes the whole forward of every stage and micro-batch (embedding, "
        f"blocks, final norm and head). Per-block checkpointing, which recomputes only the "
        f"{cfg.n_layers} blocks on the full batch, already costs {cpu('per-block'):.2f}x "
        f"plain, so the blocks' forward alone is about {cpu('per-block') - 1:.0%} of a step; "
        f"a full recompute cannot come under that. torchgpipe always vs its never: "
        f"{cpu('torchgpipe-always') / cpu('torchgpipe-never'):.2f}x; pipeckpt except_last vs "
        f"never: {cpu('pipeckpt-except_last') / cpu('pipeckpt-never'):.2f}x.",
        f"- MemTracker categories: a pipeline without reentrant checkpointing runs all "
        f"micro-batches through one `backward()`, and autograd hands a weight its gradient "
        f"only after the weight's last micro-batch; until then the sum waits in the engine's "
        f"input buffer, which MemTracker files as temporary memory. torchgpipe's never has the "
        f"same buffers ({fmt(k['torchgpipe-never'].categories_mib, 1)} vs "
        f"{fmt(k['torchgpipe-never'].peak_mib, 1)} MiB); its checkpointed modes run each "
        f"micro-batch's partition backward as a nested backward, so their gradients reach "
        f"`.grad` one micro-batch at a time. With `.grad` empty the buffer is the later `.grad` "
        f"itself (see the gradient-accumulation table); with `.grad` full it is an extra copy.",
    ]
    return lines


def report(
    *,
    cfg: Config,
    command: str,
    rounds: int,
    methods: List[Method],
    checks: Checks,
    lightning: Optional[Tuple[float, float]],
    params: int,
    elapsed: float,
) -> str:
    lines = [
        "# Checkpointing benchmark: pipeckpt against plain training and its peers",
        "",
        *(
            [
                "**Quick mode: a tiny model and one round. This checks the harness; the figures "
                "mean nothing.**",
                "",
            ]
            if cfg == QUICK
            else []
        ),
        f"Machine: {machine()}; one torch thread.",
        "",
        f"Command: `{command}` ({elapsed / 60:.1f} min).",
        "",
        f"Model: `pipeckpt.app.models.gpt.gpt_layers`, {cfg.n_layers} layers, d_model "
        f"{cfg.d_model}, {cfg.n_heads} heads, vocab {cfg.vocab_size}, seq {cfg.seq_len}, batch "
        f"{cfg.batch}, dropout {cfg.dropout}, fp32, random init, {params / 1e6:.1f}M parameters "
        f"({params * 4 / MiB:.0f} MiB). Pipelines: {cfg.stages} stages x {cfg.chunks} chunks, "
        f"balance {cfg.balance} by layer count. Optimizer: SGD without momentum.",
        "",
        "Memory (one forward + backward under `MemTracker`, pushed onto the worker threads "
        "too): activation = live tensor bytes minus parameters, buffers, optimizer state and "
        "gradients; 'peak' is the running maximum of that figure. 'held after fwd' is taken "
        "after the loss, before backward. 'peak MiB' counts the weight gradients that autograd "
        "is still summing over micro-batches as gradients (they become `.grad`); 'MemTracker "
        "categories' counts them as temporary memory, i.e. as activation.",
        "",
        f"Time: forward + backward + optimizer step; one warm-up per method, then {rounds} "
        "rounds, each running every method once, in groups of two between runs of plain; "
        "each ratio is against the mean of the plain runs around it; medians over rounds. "
        "CPU = process CPU time (all threads); the machine is shared, and CPU time is the "
        "steadier of the two. 'peak vs never': against the same family's never (plain for "
        "plain and torch). 'vs peer': pipeckpt mode X against torchgpipe mode X, and "
        "pipeckpt always against `torch.utils.checkpoint` per block.",
        "",
        *results_table(methods),
        "",
    ]
    if lightning is not None:
        lines += [
            f"Extra: one Lightning `Trainer` step with `PipelineStrategy(checkpoint="
            f'"never")` (same model and balance, SGD): {lightning[1]:.2f}x plain in CPU '
            f"time, {lightning[0]:.2f}x in wall-clock (not interleaved: one plain run "
            "before and after).",
            "",
        ]
    lines += [
        "Per round, to judge the noise:",
        "",
        *rounds_table(methods),
        "",
        "## Gradient accumulation",
        "",
        "Activations plus gradients at their peak, first with `.grad` empty (as after "
        "`zero_grad(set_to_none=True)`), then with `.grad` already holding gradients (the "
        "second batch of `accumulate_grad_batches`, or `set_to_none=False`):",
        "",
        *accumulating_table(methods),
        "",
        "## Targets",
        "",
        *targets(methods, cfg),
        "",
        "## Notes",
        "",
        "- `offload` on a machine without a GPU: a stage on the CPU has no device memory to "
        "free, so `Stage` skips `save_on_cpu` there and offload runs as always; its row "
        "measures exactly that.",
        "- 'held after fwd' is n/m for the micro-batch loop: its forwards and backwards "
        "interleave, so no moment holds a whole batch's forward.",
        "",
        "## Correctness (dropout on, same seed and weights)",
        "",
        *checks.lines,
        "",
    ]
    return "\n".join(lines)
