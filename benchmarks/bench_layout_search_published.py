"""The search's own pick against a published layout, on the published run's cluster and batch (issue
44 item 5): the search (``strategy.layout=auto``, as ``python -m pipeckpt.plan`` runs it, the model
on fake tensors from its Hugging Face config, nothing downloaded) ranks every layout whose every rank
fits the device; the published layout is looked up among them, with the modes the search gives it.
Reported: the pick's and the published layout's predicted step, tokens/s per GPU and per-rank peak,
and whether the published layout, with its own recompute, fits by the memory model at all.

The cost model prices both alike (the cluster preset's constants, ``reshard_after_forward`` the
engine's default), so the comparison is the search's: it cannot rank a layout below one it predicts
slower, and a published layout it finds no fit for is reported, not hidden.

    python benchmarks/bench_layout_search_published.py --out /tmp/search_published.md   # minutes
"""

import argparse
import time
from typing import Any, Dict, List, Optional

from bench_layout_measured import _compose
from bench_layout_published import LLAMA_8B
from harness.machine import machine

from pipeckpt.layout.report import format_row
from pipeckpt.plan_layout import search_config

CASES: List[Dict[str, Any]] = [
    {
        "name": "Llama 3.1 8B on 8 H100 (torchtitan Table 1: FSDP 8, local batch 2, seq 8192, selective AC, "
        "5,762 tok/s/GPU at 82.4 GiB)",
        "config": {**LLAMA_8B, "max_position_embeddings": 131072},
        "cluster": "h100_8",
        "devices": 8,
        "batch": 16,
        "seq": 8192,
        # pp, tp, dp_replicate, dp_shard, schedule, chunks, reshard after forward (torchtitan's default)
        "published": (1, 1, 1, 8, "gpipe", 1, True),
        "published_modes": ("selective",),
    },
]


def _config(config: Dict[str, Any]) -> str:
    return "model.config={" + ",".join(f"{k}:{v}" for k, v in config.items()) + "}"


def run(case: Dict[str, Any]) -> List[str]:
    began = time.time()
    cfg = _compose(
        [
            "model=hf",
            _config(case["config"]),
            f"model.seq_len={case['seq']}",
            "data.max_bytes=6000000",
            "strategy.engine=distributed",
            "strategy.layout=auto",
            f"cluster={case['cluster']}",
            f"trainer.devices={case['devices']}",
            f"data.batch_size={case['batch']}",
            "trainer.precision=bf16-mixed",
        ]
    )
    answer = search_config(cfg)
    ranked = answer.searched.ranked
    best = ranked[0]
    pp, tp, rep, shard, schedule, chunks, reshard = case["published"]
    mine: Optional[Any] = next(
        (
            r
            for r in ranked
            if (r.candidate.pp, r.candidate.tp, r.candidate.dp_replicate, r.candidate.dp_shard)
            == (pp, tp, rep, shard)
            and r.candidate.schedule == schedule
            and r.candidate.chunks == chunks
            and r.candidate.reshard == reshard
        ),
        None,
    )
    gib = 2**30
    lines = [
        f"### {case['name']}",
        "",
        f"{answer.searched.considered} layouts considered, {len(ranked)} fit ({time.time() - began:.0f} s):",
        "",
        "```",
        answer.text(top=5),
        "```",
        "",
    ]
    if mine is None:
        lines.append("- the published layout: **no fit** by the memory model with any mode")
    else:
        e, b = mine.estimate, best.estimate
        lines += [
            f"- the published layout, search rank {ranked.index(mine) + 1}: `{format_row(0, mine).strip()}`",
            f"  - its modes as the search gives them: {', '.join(mine.candidate.modes)} (published: "
            f"{', '.join(case['published_modes'])}); peak {mine.fitted.peak / gib:.1f} GiB",
            f"- the pick: {best.candidate.describe()} {best.candidate.schedule} x{best.candidate.chunks}, "
            f"{', '.join(best.candidate.modes)}: {b.tokens_per_s_per_device:,.0f} against "
            f"{e.tokens_per_s_per_device:,.0f} tok/s/GPU (**{e.step_s / b.step_s:.2f}x** as fast), "
            f"peak {best.fitted.peak / gib:.1f} GiB against {mine.fitted.peak / gib:.1f} GiB "
            f"(device {answer.cluster.device.memory_bytes / gib:.0f} GiB)",
        ]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/dev/stdout")
    args = parser.parse_args()
    lines = [f"On {machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    for case in CASES:
        lines += run(case)
        print("\n".join(lines), flush=True)
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
