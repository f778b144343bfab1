"""The memory/time frontier: for each peer's point (peak activations + gradients, time vs plain),
the pipeckpt configurations at or below it on both axes, and whether ``ckpt=auto`` finds one.

Peers (as in benchmarks/bench_checkpoint.py, whose measuring this reuses): ``torch.utils.checkpoint``
per block, ``checkpoint_sequential`` in 4 segments, torchgpipe never / except_last / always.
pipeckpt's candidates are auto's own search space, so modes added to
:data:`pipeckpt.memory.auto.DEFAULT_MODES` (granularity, selective) are measured here without a change:
every mode on every stage, for each chunk count that cuts the batch, plus what
:func:`pipeckpt.memory.auto.choose` picks at each peer's memory.

Auto's budget at a peer's point: the benchmark's figure is the whole process's peak of
activations + gradients; every stage runs on the one CPU, so ``choose`` gets ``shared_device=True``
(the budget is the device's, checked against the whole process's predicted peak,
:func:`pipeckpt.memory.auto.process_peak`), a budget of the peer's figure less ``--headroom`` (0.5 %) plus
all the parameters (SGD keeps no state), and the balances ``ckpt=auto memory.search=[balance]``
searches (:func:`pipeckpt.memory.budget.balance_candidates`: all of them on both configs here). The
candidates add plans shaped like per-block checkpointing (:func:`per_block_shaped`).
The headroom: the model's accounting differs from this harness's tracker by about a kilobyte either
way (mode-dependent), and with none auto picked, at ``checkpoint_sequential``'s memory, a plan
768 bytes (0.04 %) above it. The candidate table sets the model's predictions (process peak, step time)
beside the measured ones, so a wrong pick can be traced to the memory or the time model.
The tables and the figure are laid out by benchmarks/frontier_report.py.

Noise: each timed sample runs ``--repeat`` steps (the quick step takes ~10 ms); ratios are against
the plain runs around each group, and the tables give the median and the round-to-round range
(min-max); "at or below" compares medians only::

    python benchmarks/bench_frontier.py --quick --out /tmp/frontier.md     # a minute
    python benchmarks/bench_frontier.py --rounds 5 --out benchmarks/RESULTS_frontier.md  # GPT-2 small
    python benchmarks/bench_frontier.py --rounds 1 --only per-block,ckpt-seq-4,always-c1  # a subset
"""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from bench_checkpoint import (
    CPU,
    FULL,
    LR,
    QUICK,
    Config,
    ForwardBackward,
    Method,
    build_methods,
    make_batch,
    measure_memory,
    measure_time,
    whole_batch,
)
from frontier_report import draw, table
from torch.utils.checkpoint import checkpoint_sequential

from pipeckpt._errors import PipeckptConfigError
from pipeckpt.engines.local.pipeline import LocalPipeline
from pipeckpt.memory.auto import DEFAULT_MODES, choose, process_peak
from pipeckpt.memory.budget import balance_candidates, chunk_candidates
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import ModelProfile, profile
from pipeckpt.sizes import MiB
from pipeckpt.stages.partition import plan

PEERS = ("per-block", "ckpt-seq-4", "torchgpipe-never", "torchgpipe-except_last", "torchgpipe-always")


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


#: A pipeckpt configuration: the modes per stage, the chunks and the balance.
Key = Tuple[Tuple[str, ...], int, Tuple[int, ...]]


def per_block_shaped(cfg: Config) -> List[Key]:
    """Plans shaped like ``torch.utils.checkpoint`` per block: the embedding alone under ``never``,
    blocks per layer, the norm and head kept. Only the first blocks need recomputing: the peak
    comes at the end of the backward (block 0's recompute, every later gradient made), when the
    kept blocks' activations are long gone; the first third and half of the blocks are tried."""
    n = cfg.n_layers
    return [
        (("never", "always:1", "never", "never"), 1, (1, k, n - k, 2))
        for k in sorted({max(1, n // 3), max(1, n // 2)})
    ]


def pipeckpt_method(
    model: torch.nn.Sequential, cfg: Config, modes: Sequence[str], chunks: int, balance: Sequence[int]
) -> Method:
    stage_plan = plan(model, devices=[CPU], balance=list(balance), checkpoint=list(modes), chunks=chunks)
    engine = LocalPipeline(model, stage_plan, chunks=chunks, pin_memory=False)
    name = modes[0] if len(set(modes)) == 1 else "/".join(modes)
    cut = "" if list(balance) == list(cfg.balance) else f"-b{''.join(map(str, balance))}"
    return Method(
        f"pipeckpt-{name}-c{chunks}{cut}",
        f"pipeckpt {name}, {chunks} chunks" + (f", balance {list(balance)}" if cut else ""),
        "pipeckpt",
        name,
        whole_batch(engine.forward),
    )


def _key(name: str) -> str:
    """A method key as ``--only`` names it: peers as they are, candidates without ``pipeckpt-``."""
    name = name.strip()
    return name if name in ("plain", *PEERS) or name.startswith("pipeckpt-") else f"pipeckpt-{name}"


def _repeated(run: ForwardBackward, repeat: int) -> ForwardBackward:
    """``repeat`` forward + backward passes per timed sample (gradients accumulate; the optimizer
    steps once, the same for every method): a 10 ms step is too short to time alone."""
    if repeat == 1:
        return run

    def runs(x: torch.Tensor, y: torch.Tensor, probe: Callable[[torch.Tensor], None]) -> torch.Tensor:
        for _ in range(repeat - 1):
            run(x, y, probe)
        return run(x, y, probe)

    return runs


@dataclass
class Predicted:
    """The model's figures for one pipeckpt configuration (every stage on the one CPU)."""

    process_mib: float
    step_ms: float


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="the tables (Markdown); the PNG goes beside it")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated method keys to measure (plain always runs): peers as in PEERS, "
        "pipeckpt candidates as MODE-cCHUNKS, e.g. 'per-block,ckpt-seq-4,always-c1,always:1-c1'",
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="steps per timed sample (default 10 with --quick, else 1)"
    )
    parser.add_argument(
        "--profile-rounds",
        type=int,
        default=10,
        help="timing rounds of the profile auto plans from (a median; 2 let one stall skew a layer)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.005,
        help="share of a peer's figure auto's budget leaves for the memory model's error (its pick lands "
        "up to ~1.5 KiB above the prediction on the quick GPT; 0 plans to the byte)",
    )
    args = parser.parse_args(argv)
    only: Optional[Set[str]] = None if args.only is None else {_key(k) for k in args.only.split(",") if k}
    repeat = args.repeat if args.repeat is not None else (10 if args.quick else 1)
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
    methods = [m for m in methods if only is None or m.key == "plain" or m.key in only]
    peers = [m.key for m in methods if m.key in PEERS]
    chunk_options = chunk_candidates(cfg.batch, cfg.chunks)
    candidates: Dict[Key, Method] = {}
    for c in chunk_options:
        for mode in DEFAULT_MODES:
            modes = (mode.name,) * cfg.stages
            method = pipeckpt_method(model, cfg, modes, c, cfg.balance)
            if only is None or method.key in only:
                candidates[(modes, c, tuple(cfg.balance))] = method
    if cfg.stages == 4:
        for key in per_block_shaped(cfg):
            method = pipeckpt_method(model, cfg, *key)
            if only is None or method.key in only:
                candidates[key] = method
    for m in methods + list(candidates.values()):
        measure_memory(m, model, x, y, seed=0)
    profiles = {
        c: profile(model, x.chunk(c)[0], loss_fn=_loss, target=y.chunk(c)[0], rounds=args.profile_rounds)
        for c in chunk_options
    }
    all_params = sum(p.numel() * p.element_size() for p in model.parameters())
    by_key = {m.key: m for m in methods}
    autos: Dict[Tuple[str, float], Optional[Key]] = {}  # (peer, headroom) -> auto's pick
    # The balances `ckpt=auto memory.search=[balance]` searches (pipeckpt.memory.budget).
    balances = balance_candidates(sum(cfg.balance), cfg.stages, cfg.balance)
    headrooms = (0.0, args.headroom)
    for peer in peers:
        figure = int(by_key[peer].footprint_mib * MiB)
        for headroom in headrooms:
            try:
                got = choose(
                    profiles,
                    int(figure * (1 - headroom)) + all_params,
                    balance=cfg.balance,
                    balances=balances,
                    chunks=chunk_options,
                    optimizer="sgd",
                    shared_device=True,
                )
            except PipeckptConfigError:
                autos[(peer, headroom)] = None
                continue
            key = (tuple(m.name for m in got.modes), got.chunks, tuple(got.balance))
            if key not in candidates:
                candidates[key] = pipeckpt_method(model, cfg, *key)
                measure_memory(candidates[key], model, x, y, seed=0)
            autos[(peer, headroom)] = key
    predicted = {key: _predicted(profiles[key[1]], model, key, all_params) for key in candidates}
    everything = methods + list(candidates.values())
    for m in everything:
        m.run = _repeated(m.run, repeat)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    measure_time(
        everything, x, y, optimizer, rounds=args.rounds, group=3, log=lambda s: print(s, file=sys.stderr)
    )
    lines = table(by_key, peers, candidates, predicted, autos, cfg, args.rounds, repeat, headrooms)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        draw(by_key, peers, candidates, autos, Path(args.out).with_suffix(".png"))
    return 0


def _predicted(prof: ModelProfile, model: torch.nn.Sequential, key: Key, all_params: int) -> Predicted:
    modes, chunks, balance = key
    stage_plan = plan(model, devices=[CPU], balance=list(balance), checkpoint=list(modes), chunks=chunks)
    whole = process_peak(prof, stage_plan, chunks=chunks, optimizer="sgd")
    step = predict(prof, stage_plan, chunks=chunks, optimizer="sgd", shared_device=True).step_time_s
    return Predicted(process_mib=(whole - all_params) / MiB, step_ms=step * 1e3)


if __name__ == "__main__":
    sys.exit(main())
