"""The search's own pick against published layouts, on each published run's cluster and batch (issue
44 item 5): the search (``strategy.layout=auto``, as ``python -m pipeckpt.plan`` runs it, the model
on fake tensors from its Hugging Face config, nothing downloaded) ranks every layout whose every rank
fits the device; each published layout is looked up among them, with the modes the search gives it.
Reported: the pick's and the published layout's predicted step, tokens/s per GPU and per-rank peak;
the published layout with its own published recompute (its peak by the memory model, and whether it
fits; its step by the cost model); and the fastest layout at or under the published layout's peak.

The runs are benchmarks/bench_layout_published.py's (torchtitan's Llama 3.1 8B on 8 H100 and 405B on
512; Megatron-LM SC'21 Table 1's GPT rows on 32 to 1,536 A100, as HF GPT-NeoX configs of their h,
layers, heads, V = 51,200 and s = 2048), with their layouts and assumptions; runs on the same
cluster and batch share one search. A multi-node run takes its preset with ``cluster.nodes`` set.

The cost model prices every layout alike (the cluster preset's constants), so the comparison is the
search's: it cannot rank a layout below one it predicts slower, and a published layout it finds no
fit for, or cannot search, is reported, not hidden.

    python benchmarks/bench_layout_search_published.py --out /tmp/search_published.md   # minutes per row
    python benchmarks/bench_layout_search_published.py --only GPT   # rows whose name has GPT
"""

import argparse
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from bench_layout_measured import _compose
from bench_layout_published import RUNS, Run
from harness.machine import machine

from pipeckpt.engines.distributed.schedules import lookup
from pipeckpt.layout.candidates import Candidate
from pipeckpt.layout.search import Ranked
from pipeckpt.plan_layout import Answer, _cost, _searching, search_config

GIB = 2**30
#: The published rows searched: torchtitan's FSDP 128 row is the H100 efficiency's fit, not a layout
#: the brief compares (its search is the acceptance's 8B one scaled to 128 devices).
SEARCHED = [r for r in RUNS if r.source != "torchtitan Table 3"]


def cases(runs: Sequence[Run]) -> List[Tuple[Run, List[Run]]]:
    """Runs grouped by what the search sees (model, cluster, nodes, batch, sequence): one search each."""
    groups: Dict[Any, List[Run]] = {}
    for r in runs:
        key = (r.preset, r.nodes, tuple(sorted(r.config.items())), r.global_batch, r.seq_len)
        groups.setdefault(key, []).append(r)
    return [(g[0], g) for g in groups.values()]


def published_layout(run: Run) -> Candidate:
    return replace(run.layout, reshard=run.reshard)


def _config(config: Dict[str, Any]) -> str:
    if config.get("model_type") == "llama":  # config.json's context, as the 8B acceptance search takes it
        config = {**config, "max_position_embeddings": 131072}
    return "model.config={" + ",".join(f"{k}:{v}" for k, v in config.items()) + "}"


def overrides(run: Run) -> List[str]:
    per_node = 8  # every preset here is 8 GPUs a node
    return [
        "model=hf",
        _config(run.config),
        f"model.seq_len={run.seq_len}",
        # the bundled text, enough that its validation half holds one global batch (the app checks)
        f"data.max_bytes={int(2.2 * run.global_batch * run.seq_len) + 1_000_000}",
        "data.val_fraction=0.5",
        "strategy.engine=distributed",
        "strategy.layout=auto",
        f"cluster={run.preset}",
        f"cluster.nodes={run.nodes}",
        f"trainer.devices={per_node}",
        f"trainer.num_nodes={run.nodes}",
        f"data.batch_size={run.global_batch}",
        "trainer.precision=bf16-mixed",
    ]


def _same(a: Candidate, b: Candidate) -> bool:
    fields = ("pp", "tp", "dp_replicate", "dp_shard", "schedule", "virtual_stages", "chunks", "reshard")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


#: One published layout with its own modes: each pipeline rank's peak (None where the search cannot
#: split the model as published) and its step by the cost model.
Own = Tuple[Optional[Tuple[int, ...]], Any]


def own_modes(cfg: Any, runs: Sequence[Run]) -> Dict[str, Tuple[Own, Optional[Own]]]:
    """Each published layout with its own published modes, predicted as the search predicts a layout
    given by hand (:meth:`pipeckpt.layout.fit.Memory.fit` keeps given modes); and the same reducing
    every micro-batch (``reduce_every_microbatch``) where it shards and has several micro-batches
    under a whole backward (None elsewhere)."""
    out: Dict[str, Tuple[Own, Optional[Own]]] = {}
    torch.manual_seed(cfg.seed)
    with _searching(cfg) as (memory, model, where, shapes):
        price = _cost(cfg, memory, where, shapes)

        def predicted(c: Candidate) -> Own:
            if c.tp > 1 and not model.tensor_parallel:
                return None, price(c)
            return memory.fit(c).peaks, price(c)

        for run in runs:
            c = published_layout(run)
            each = c.dp_shard > 1 and c.chunks > 1 and not lookup(c.schedule).traits.split_backward
            out[run.name] = (predicted(c), predicted(replace(c, reduce_every=True)) if each else None)
    return out


def _pick(r: Ranked) -> str:
    c, e = r.candidate, r.estimate
    return (
        f"{c.describe()} {c.schedule}{f' (v{c.virtual_stages})' if c.virtual_stages > 1 else ''} "
        f"x{c.chunks}, "
        f"{', '.join(c.modes)}: {e.step_s * 1e3:,.0f} ms, {e.tokens_per_s_per_device:,.0f} tok/s/GPU, "
        f"peak {r.fitted.peak / GIB:.1f} GiB"
    )


def report(
    run: Run,
    answer: Answer,
    own: Own,
    every: Optional[Own] = None,
) -> List[str]:
    """The published layout against the pick: in the search's ranking (its modes as the search
    gives them), with its own published modes, and the fastest layout within its memory."""
    ranked = answer.searched.ranked
    best = ranked[0]
    device = answer.cluster.device.memory_bytes
    c = published_layout(run)
    mine = next((r for r in ranked if _same(r.candidate, c)), None)
    peaks, step = own
    lines = [f"- **{run.name}** ({run.source}: {run.published_text}, {run.published:,.0f} tok/s/GPU)"]
    fits = peaks is not None and max(peaks) <= device
    if peaks is None:
        lines.append(
            f"  - with its own modes ({', '.join(c.modes)}): {step.step_s * 1e3:,.0f} ms, "
            f"{step.tokens_per_s_per_device:,.0f} tok/s/GPU by the cost model; its memory is not "
            f"modelled: the search cannot split this model (tp {c.tp}: no tensor-parallel plan)"
        )
    else:
        lines.append(
            f"  - with its own modes ({', '.join(c.modes)}): peak {max(peaks) / GIB:.1f} GiB, "
            f"{'fits' if fits else '**does not fit**'} {device / GIB:.1f} GiB; {step.step_s * 1e3:,.0f} ms, "
            f"{step.tokens_per_s_per_device:,.0f} tok/s/GPU"
        )
    if every is not None and every[0] is not None:
        lines.append(
            f"  - the same reducing every micro-batch (`reduce_every_microbatch`): peak "
            f"{max(every[0]) / GIB:.1f} GiB, {every[1].step_s * 1e3:,.0f} ms, "
            f"{every[1].tokens_per_s_per_device:,.0f} tok/s/GPU"
        )
    if mine is None:
        why = "not searched" if peaks is None else "no modes fit"
        lines.append(f"  - among the search's {len(ranked)} layouts: **not there** ({why})")
    else:
        lines.append(
            f"  - search rank {ranked.index(mine) + 1} of {len(ranked)}, modes as the search gives them: "
            f"{_pick(mine)}"
        )
    # the published layout's time: the search's version of it, else its own modes'; its memory:
    # its own modes' peak where that fits, else the search's version's, else the device
    rival = mine.estimate.step_s if mine is not None else step.step_s
    bar = max(peaks) if peaks is not None and fits else mine.fitted.peak if mine is not None else device
    lines.append(
        f"  - the pick against it: **{rival / best.estimate.step_s:.2f}x** as fast, peak "
        f"{best.fitted.peak / GIB:.1f} GiB against {bar / GIB:.1f} GiB"
    )
    under = next((r for r in ranked if r.fitted.peak <= bar), None)
    if under is None:
        lines.append(f"  - no layout the search found fits within {bar / GIB:.1f} GiB")
    else:
        lines.append(
            f"  - the fastest within {bar / GIB:.1f} GiB (rank {ranked.index(under) + 1}): {_pick(under)} "
            f"(**{rival / under.estimate.step_s:.2f}x**)"
        )
    return lines


def run_case(first: Run, runs: Sequence[Run]) -> List[str]:
    cfg = _compose(overrides(first))
    began, cpu = time.time(), time.process_time()
    answer = search_config(cfg)
    wall, cpu = time.time() - began, time.process_time() - cpu
    ranked = answer.searched.ranked
    own = own_modes(cfg, runs)
    gpus = first.nodes * 8
    lines = [
        f"### {first.config.get('model_type')} {', '.join(r.name for r in runs)}",
        "",
        f"`{first.preset}` with `cluster.nodes={first.nodes}` ({gpus} GPUs), global batch "
        f"{first.global_batch}, seq {first.seq_len}: {answer.searched.considered} layouts considered, "
        f"{len(ranked)} fit; the search {wall:.0f} s wall, {cpu:.0f} s CPU",
        "",
        "```",
        answer.text(top=5),
        "```",
        "",
        f"- the pick: {_pick(ranked[0])}",
    ]
    for run in runs:
        lines += report(run, answer, *own[run.name])
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also append the results to this file")
    parser.add_argument("--only", default="", help="search only the runs whose name has this text")
    args = parser.parse_args()
    lines = [f"On {machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    print(lines[0], flush=True)
    for first, runs in cases([r for r in SEARCHED if args.only in r.name]):
        done = run_case(first, runs)
        print("\n".join(done), flush=True)
        lines += done
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
