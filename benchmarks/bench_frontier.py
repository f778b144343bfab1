"""The memory/time frontier: for each peer's point (peak activations + gradients, time vs plain),
the pipeckpt configurations at or below it on both axes, and whether ``ckpt=auto`` finds one.

Peers (as in benchmarks/bench_checkpoint.py, whose measuring this reuses): ``torch.utils.checkpoint``
per block, ``checkpoint_sequential`` in 4 segments, torchgpipe never / except_last / always.
pipeckpt's candidates are auto's own search space, so modes added to
:data:`pipeckpt.auto.DEFAULT_MODES` (granularity, selective) are measured here without a change:
every mode on every stage, for each chunk count that cuts the batch, plus what
:func:`pipeckpt.auto.choose` picks at each peer's memory.

Auto's budget at a peer's point: the benchmark's figure is the whole device's activations +
gradients; the memory model's per-stage peak also counts the stage's parameters (SGD keeps no
state). With every stage on the one CPU the budget handed to ``choose`` is the peer's figure
plus the largest stage's parameters, an approximation that this table then checks by measuring
the chosen configuration::

    python benchmarks/bench_frontier.py --quick --out /tmp/frontier.md     # a minute
    python benchmarks/bench_frontier.py --rounds 5 --out benchmarks/RESULTS_frontier.md  # GPT-2 small
"""

import argparse
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint_sequential

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine
from bench_checkpoint import (
    CPU,
    FULL,
    LR,
    QUICK,
    Config,
    Method,
    build_methods,
    make_batch,
    measure_memory,
    measure_time,
    whole_batch,
)

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.auto import DEFAULT_MODES, choose
from pipeckpt.budget import chunk_candidates
from pipeckpt.engines.local_pipeline import LocalPipeline
from pipeckpt.memory import profile
from pipeckpt.planning import plan

MiB = 2**20
PEERS = ("per-block", "ckpt-seq-4", "torchgpipe-never", "torchgpipe-except_last", "torchgpipe-always")


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def pipeckpt_method(model: torch.nn.Sequential, cfg: Config, modes: Sequence[str], chunks: int) -> Method:
    stage_plan = plan(model, devices=[CPU], balance=cfg.balance, checkpoint=list(modes), chunks=chunks)
    engine = LocalPipeline(model, stage_plan, chunks=chunks, pin_memory=False)
    name = modes[0] if len(set(modes)) == 1 else "/".join(modes)
    return Method(
        f"pipeckpt-{name}-c{chunks}",
        f"pipeckpt {name}, {chunks} chunks",
        "pipeckpt",
        name,
        whole_batch(engine.forward),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = QUICK if args.quick else FULL
    torch.manual_seed(0)
    model = cfg.layers()
    x, y = make_batch(cfg)
    methods = [m for m in build_methods(model, cfg) if m.key in ("plain", *PEERS)]
    methods.insert(
        2,
        Method(
            "ckpt-seq-4",
            "`checkpoint_sequential`, 4 segments",
            "torch",
            None,
            whole_batch(lambda t: checkpoint_sequential(model, 4, t, use_reentrant=False)),
        ),
    )
    chunk_options = chunk_candidates(cfg.batch, cfg.chunks)
    candidates: Dict[Tuple[Tuple[str, ...], int], Method] = {}
    for c in chunk_options:
        for mode in DEFAULT_MODES:
            modes = (mode.name,) * cfg.stages
            candidates[(modes, c)] = pipeckpt_method(model, cfg, modes, c)
    for m in methods + list(candidates.values()):
        measure_memory(m, model, x, y, seed=0)
    # auto at each peer's memory
    profiles = {
        c: profile(model, x.chunk(c)[0], loss_fn=_loss, target=y.chunk(c)[0], rounds=2) for c in chunk_options
    }
    stage_params = [
        sum(p.numel() * p.element_size() for layer in list(model)[a:b] for p in layer.parameters())
        for a, b in plan(model, devices=[CPU], balance=cfg.balance, checkpoint="never").ranges
    ]
    by_key = {m.key: m for m in methods}
    autos: Dict[str, Optional[Tuple[Tuple[str, ...], int]]] = {}
    for peer in PEERS:
        budget = int(by_key[peer].footprint_mib * MiB) + max(stage_params)
        try:
            got = choose(
                profiles,
                budget,
                balance=cfg.balance,
                chunks=chunk_options,
                optimizer="sgd",
                shared_device=True,
            )
        except PipeckptConfigError:
            autos[peer] = None
            continue
        key = (tuple(m.name for m in got.modes), got.chunks)
        if key not in candidates:
            candidates[key] = pipeckpt_method(model, cfg, key[0], key[1])
            measure_memory(candidates[key], model, x, y, seed=0)
        autos[peer] = key
    everything = methods + list(candidates.values())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    measure_time(
        everything, x, y, optimizer, rounds=args.rounds, group=3, log=lambda s: print(s, file=sys.stderr)
    )
    lines = _table(by_key, candidates, autos, cfg, args.rounds)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        _draw(by_key, candidates, Path(args.out).with_suffix(".png"))
    return 0


def _point(m: Method) -> Tuple[float, float]:
    return m.footprint_mib or 0.0, statistics.median(m.cpu_ratios)


def _table(by_key, candidates, autos, cfg: Config, rounds: int) -> List[str]:
    lines = [
        f"# Frontier: peak activations + gradients (MiB) and CPU time vs plain ({rounds} interleaved rounds, "
        "medians)",
        f"{machine()}; GPT d {cfg.d_model} x {cfg.n_layers}, vocab {cfg.vocab_size}, seq {cfg.seq_len}, "
        f"batch {cfg.batch}, {cfg.stages} stages; pipeckpt candidates: modes "
        f"{[m.name for m in DEFAULT_MODES]} "
        f"on every stage x chunks {sorted({c for _, c in candidates})}",
        "",
        "| peer | peak act+grad MiB | time vs plain | pipeckpt at or below on both "
        "| auto at the peer's memory | auto's point |",
        "|---|---|---|---|---|---|",
    ]
    for peer in PEERS:
        pm, pt = _point(by_key[peer])
        below = [m for m in candidates.values() if _point(m)[0] <= pm and _point(m)[1] <= pt]
        names = ", ".join(f"{m.label} ({_point(m)[0]:.1f}, {_point(m)[1]:.2f})" for m in below) or "none"
        auto = autos[peer]
        if auto is None:
            found, point = "no plan fits", "-"
        else:
            m = candidates[auto]
            am, at = _point(m)
            found = f"{m.label}: " + ("at or below" if am <= pm and at <= pt else "not below")
            point = f"{am:.1f}, {at:.2f}"
        lines.append(f"| {by_key[peer].label} | {pm:.1f} | {pt:.2f} | {names} | {found} | {point} |")
    lines += ["", "| pipeckpt candidate | peak act+grad MiB | time vs plain |", "|---|---|---|"]
    for m in candidates.values():
        lines.append(f"| {m.label} | {_point(m)[0]:.1f} | {_point(m)[1]:.2f} |")
    return lines


def _draw(by_key, candidates, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for key in PEERS:
        m, t = _point(by_key[key])
        ax.scatter([m], [t], marker="s", color="tab:red")
        ax.annotate(key, (m, t), fontsize="x-small")
    for m in candidates.values():
        mm, t = _point(m)
        ax.scatter([mm], [t], marker="o", color="tab:blue")
        ax.annotate(m.key.replace("pipeckpt-", ""), (mm, t), fontsize="x-small")
    ax.set_xlabel("peak activations + gradients, MiB")
    ax.set_ylabel("CPU time vs plain")
    ax.set_title("frontier: peers (red squares), pipeckpt (blue)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
