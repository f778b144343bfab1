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
    python benchmarks/bench_layout_search_published.py --top 5      # the 5 fastest a row: minutes

With ``--top``, the search fits only the layouts that can be among the fastest (a step floor,
pipeckpt/layout/floor.py); the published layout is then fitted on its own, and the fastest layout
within its memory found by the search again with the device cut to that memory.
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
        key = (
            r.preset,
            r.nodes,
            tuple(sorted(r.config.items())),
            r.global_batch,
            r.seq_len,
            r.sequence_parallel,
        )
        groups.setdefault(key, []).append(r)
    return [(g[0], g) for g in groups.values()]


def published_layout(run: Run) -> Candidate:
    """The run's layout as published: its resharding, and sequence parallelism where its tp splits
    the sequence too (torchtitan's plan does), as the search's own twin of it has."""
    return replace(run.layout, reshard=run.reshard, sequence=run.sequence_parallel and run.layout.tp > 1)


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
        # as published: off is said, else the search would run it on every split layout
        f"strategy.sequence_parallel={str(run.sequence_parallel).lower()}",
    ]


def _same(a: Candidate, b: Candidate) -> bool:
    """``a`` (the search's) is the published layout ``b``, under the engine's cut by parameters (its
    twin cut by time is the search's own layout, not the published one)."""
    fields = (
        "pp",
        "tp",
        "dp_replicate",
        "dp_shard",
        "schedule",
        "virtual_stages",
        "chunks",
        "reshard",
        "sequence",
    )
    return not a.balance and all(getattr(a, f) == getattr(b, f) for f in fields)


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
                return None, price.estimate(c)
            return memory.fit(c).peaks, price.estimate(c)

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


def _where(ranked: Sequence[Ranked], found: Optional[Ranked], bounded: bool) -> str:
    """``rank 3 of 40``, or where the search ranked only the fastest (``--top``), that it is not
    among them."""
    if found is None:
        return ""
    if found in ranked:
        return f"rank {ranked.index(found) + 1} of {len(ranked)}"
    return f"not among the {len(ranked)} fastest" if bounded else "not ranked"


def report(
    run: Run,
    answer: Answer,
    own: Own,
    every: Optional[Own] = None,
    *,
    mine: Optional[Ranked] = None,
    under: Optional[Ranked] = None,
    within: Optional[Ranked] = None,
    bounded: bool = False,
) -> List[str]:
    """The published layout against the pick: as the search fits it (``mine``: its modes as the
    search gives them), with its own published modes, and the fastest layout within its memory
    (``under``, searched again with the device cut to that memory where the search was ``--top``),
    against the published layout's fastest modes within that memory (``within``: fitted under the
    cut device; else the search's version where it fits there, else its own modes)."""
    ranked = answer.searched.ranked
    best = ranked[0]
    device = answer.cluster.device.memory_bytes
    c = published_layout(run)
    if mine is None:
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
        lines.append(f"  - {_where(ranked, mine, bounded)}, modes as the search gives them: {_pick(mine)}")
    # the published layout's time: the search's version of it, else its own modes'
    rival = mine.estimate.step_s if mine is not None else step.step_s
    bar = _bar(answer, own, mine)
    lines.append(
        f"  - the pick against it: **{rival / best.estimate.step_s:.2f}x** as fast, peak "
        f"{best.fitted.peak / GIB:.1f} GiB against {bar / GIB:.1f} GiB"
    )
    if under is None:
        under = next((r for r in ranked if r.fitted.peak <= bar), None)
    if within is None and mine is not None and mine.fitted.peak <= bar:
        within = mine
    same = within.estimate.step_s if within is not None else step.step_s
    if within is not None and within is not mine:
        lines.append(f"  - the published layout within {bar / GIB:.1f} GiB, fastest modes: {_pick(within)}")
    if under is None:
        lines.append(f"  - no layout the search found fits within {bar / GIB:.1f} GiB")
    else:
        lines.append(
            f"  - the fastest within {bar / GIB:.1f} GiB ({_where(ranked, under, bounded)}): "
            f"{_pick(under)} (**{same / under.estimate.step_s:.2f}x** the published layout in that memory)"
        )
    return lines


def _bar(answer: Answer, own: Own, mine: Optional[Ranked]) -> int:
    """The memory the published layout takes: its own modes' peak where that fits the device, else
    its peak as the search fits it, else the device."""
    device = answer.cluster.device.memory_bytes
    peaks = own[0]
    if peaks is not None and max(peaks) <= device:
        return max(peaks)
    return mine.fitted.peak if mine is not None else device


def _bounded(cfg: Any, answer: Answer, runs: Sequence[Run], own: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per run, for a search of the fastest only: its published layout as the search fits it (one
    layout searched), and the fastest layout within its memory (the search again, ``top=1``, the
    device cut to that memory)."""
    out: Dict[str, Dict[str, Any]] = {}
    for run in runs:
        c = replace(published_layout(run), modes=())
        found = search_config(cfg, only=[c]).searched.ranked if own[run.name][0][0] is not None else ()
        mine = found[0] if found else None
        bar = _bar(answer, own[run.name][0], mine)
        cut = cfg.copy()
        cut.cluster.device.memory_bytes = bar
        under = answer.searched.ranked[0] if answer.searched.ranked[0].fitted.peak <= bar else None
        if under is None:
            fastest = search_config(cut, top=1).searched.ranked
            under = fastest[0] if fastest else None
        inside = search_config(cut, only=[c]).searched.ranked if own[run.name][0][0] is not None else ()
        within = inside[0] if inside else None
        out[run.name] = {"mine": mine, "under": under, "within": within, "bounded": True}
    return out


def run_case(first: Run, runs: Sequence[Run], top: Optional[int] = None) -> List[str]:
    cfg = _compose(overrides(first))
    began, cpu = time.time(), time.process_time()
    answer = search_config(cfg, top=top)
    wall, cpu = time.time() - began, time.process_time() - cpu
    ranked = answer.searched.ranked
    own = own_modes(cfg, runs)
    given = _bounded(cfg, answer, runs, own) if top else {}
    gpus = first.nodes * 8
    counted = (
        f"the {len(ranked)} fastest that fit ({answer.searched.dropped_at('floor')} not fitted: slower "
        "whatever their modes)"
        if top
        else f"{len(ranked)} fit"
    )
    lines = [
        f"### {first.config.get('model_type')} {', '.join(r.name for r in runs)}",
        "",
        f"`{first.preset}` with `cluster.nodes={first.nodes}` ({gpus} GPUs), global batch "
        f"{first.global_batch}, seq {first.seq_len}: {answer.searched.considered} layouts considered, "
        f"{counted}; the search {wall:.0f} s wall, {cpu:.0f} s CPU",
        "",
        "```",
        answer.text(top=5),
        "```",
        "",
        f"- the pick: {_pick(ranked[0])}",
    ]
    for run in runs:
        lines += report(run, answer, *own[run.name], **given.get(run.name, {}))
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also append the results to this file")
    parser.add_argument("--only", default="", help="search only the runs whose name has this text")
    parser.add_argument(
        "--top",
        type=int,
        default=None,
        help="rank only the N fastest (search_config(top=N): minutes where every layout takes an hour)",
    )
    args = parser.parse_args()
    lines = [f"On {machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    print(lines[0], flush=True)
    for first, runs in cases([r for r in SEARCHED if args.only in r.name]):
        done = run_case(first, runs, args.top)
        print("\n".join(done), flush=True)
        lines += done
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
