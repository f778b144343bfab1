"""The layout cost model against published training runs, on paper (issue 44 item 5).

Each row is a run someone published with its layout, batch, sequence, recompute and achieved
throughput; the cost model (pipeckpt/layout/cost.py) predicts its step from the model's config and
the cluster preset of its device kind (conf/cluster/*.yaml), with ONE efficiency per device kind.
That efficiency is fitted on one run per kind (``--fit`` prints the fit; the presets hold it) and
marked "fit" in the table; every other row is a prediction.

Sources:
- torchtitan, Llama 3.1 on H100 (Grand Teton: 8 H100 96GB HBM2e, 500 W, NVLink, 400 Gb/s RDMA per
  GPU), end of 2024: https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md
  Table 1 (8B, FSDP 8), Table 3 (8B, FSDP 128; the H100 fit), Table 5 (405B, PP 8 x TP 8 x FSDP 8).
  Its docs/performance.md of 2024 (before that file's tables moved to the page above): Llama 3.1
  405B on 128 H100 (95GB) as FSDP 16 x TP 8, local batch 2, full AC, in bf16 without Float8 or
  torch.compile: 109 tokens/s per GPU at 29.0% MFU (the only published 405B run in plain bf16).
- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  SC'21 (arXiv:2104.04473), Table 1 (GPT, V = 51,200, s = 2048, A100 80GB on Selene); achieved
  teraFLOP/s per GPU become tokens/s per GPU through their Eq. 3, which counts the recompute:
  ``F / (B s) = 96 l h^2 (1 + s / 6h + V / 16 l h)`` FLOPs per token. The 1.7B row is the A100 fit.
  The table was read from a transcription (the PDF was not reachable when this was written); its
  last row agrees with the paper's abstract (1T, 3,072 GPUs, 163 teraFLOP/s per GPU, 502 petaFLOP/s).

Run settings the sources do not state are assumptions, named in each row's note.

    python benchmarks/bench_layout_published.py            # the table (a second)
    python benchmarks/bench_layout_published.py --fit      # and the efficiency each fit row implies
"""

import argparse
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from harness.efficiency import bisect_efficiency, with_efficiency

from pipeckpt.layout.candidates import Candidate as Layout  # the search's own layout record
from pipeckpt.layout.cluster import Cluster, cluster
from pipeckpt.layout.cost import StepEstimate, estimate
from pipeckpt.layout.model_costs import ModelCosts, model_costs_from_config

LLAMA_8B = dict(  # Llama 3.1 8B's config.json
    model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, hidden_act="silu",
)  # fmt: skip
LLAMA_405B = dict(  # Llama 3.1 405B's config.json
    model_type="llama", hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
    num_key_value_heads=8, intermediate_size=53248, vocab_size=128256, hidden_act="silu",
)  # fmt: skip


def gpt(h: int, heads: int, layers: int) -> Dict[str, Any]:
    """Megatron's GPT of Table 1 (a 4h GELU MLP, V = 51,200, s = 2048) as an HF GPT-NeoX config: the
    GPT of Megatron's lineage, its residuals in sequence as Megatron's. GPT-2 would be the other
    stand-in, but its layers are ``Conv1D``, which torch's tensor-parallel styles do not split, and
    it states no plan; GPT-NeoX's plan splits every layer over tp as Megatron does, its
    query-key-value projection grouped by head. Untied: Megatron ties the head to the embedding
    but splits both over the vocabulary across t, and holds a copy on the last stage, as an untied
    GPT-NeoX's plan splits its two (a tied one stays whole on every tp rank); at p1 this counts V h
    parameters more than Megatron's (7% of 1.7B, 0.4% of 145.6B). Its rotary positions replace
    Megatron's learnt ones (2,048 h parameters; no matmul FLOPs). Dropout 0.1 on attention and the
    residuals, Megatron-LM's defaults (the paper does not say what its runs set; GPT-NeoX's own
    default is none, and the masks a dropout keeps are activation memory)."""
    return dict(
        model_type="gpt_neox", hidden_size=h, num_attention_heads=heads, num_hidden_layers=layers,
        intermediate_size=4 * h, vocab_size=51200, max_position_embeddings=2048, hidden_act="gelu",
        use_parallel_residual=False, tie_word_embeddings=False, hidden_dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    preset: str
    nodes: int
    config: Dict[str, Any]
    layout: Layout
    global_batch: int
    seq_len: int
    published: float  # tokens/s per device
    published_text: str
    fit: bool = False
    reshard: bool = False
    stage_layers: Optional[Tuple[int, ...]] = None
    torchtitan_sac: bool = False  # torchtitan's selective op policy (recomputes every second matmul)
    sequence_parallel: bool = False  # the run's tp splits the sequence too (torchtitan's TP plan does)
    note: str = ""


def megatron_tokens(tflops: float, h: int, layers: int, s: int = 2048, v: int = 51200) -> float:
    """Their Eq. 3 per token: tokens/s per GPU from achieved teraFLOP/s per GPU."""
    return tflops * 1e12 / (96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))


def megatron(params: str, h: int, heads: int, layers: int, t: int, p: int, n: int, batch: int, tf: float,
             *, fit: bool = False) -> Run:  # fmt: skip
    d = n // (t * p)
    chunks = batch // d  # micro-batches of 1 (their Table 2's PTD-P runs; Table 1 does not say)
    note = "1F1B, micro-batches of 1, full recompute (Table 1 names no schedule or micro-batch)"
    return Run(
        name=f"GPT {params} (t{t} x p{p} x d{d}, {n} GPUs, batch {batch})",
        source="Megatron-LM SC'21 Table 1",
        preset="a100_8x8",
        nodes=n // 8,
        config=gpt(h, heads, layers),
        layout=Layout(p, t, d, 1, "1f1b" if p > 1 else "gpipe", 1, chunks, ("always",) * p),
        global_batch=batch,
        seq_len=2048,
        published=megatron_tokens(tf, h, layers),
        published_text=f"{tf:g} TFLOP/s/GPU",
        fit=fit,
        note=note,
    )


RUNS: List[Run] = [
    Run(
        name="Llama 3.1 8B, FSDP 128, local batch 2, selective AC",
        source="torchtitan Table 3",
        preset="h100_8x8",
        nodes=16,
        config=LLAMA_8B,
        layout=Layout(1, 1, 1, 128, "gpipe", 1, 1, ("selective",)),
        global_batch=256,
        seq_len=8192,
        published=5605,
        published_text="5,605 tok/s/GPU",
        fit=True,
        reshard=True,
        torchtitan_sac=True,
        note="reshard after forward (torchtitan's default without PP)",
    ),
    Run(
        name="Llama 3.1 8B, FSDP 8, local batch 2, selective AC",
        source="torchtitan Table 1",
        preset="h100_8",
        nodes=1,
        config=LLAMA_8B,
        layout=Layout(1, 1, 1, 8, "gpipe", 1, 1, ("selective",)),
        global_batch=16,
        seq_len=8192,
        published=5762,
        published_text="5,762 tok/s/GPU",
        reshard=True,
        torchtitan_sac=True,
        note="reshard after forward (torchtitan's default without PP)",
    ),
    Run(
        name="Llama 3.1 405B, PP 8 x TP 8 x FSDP 8, 1F1B, full AC",
        source="torchtitan Table 5",
        preset="h100_8x8",
        nodes=64,
        config=LLAMA_405B,
        layout=Layout(8, 8, 1, 8, "1f1b", 1, 32, ("always",) * 8),
        sequence_parallel=True,
        global_batch=256,
        seq_len=8192,
        published=100,
        published_text="100 tok/s/GPU",
        stage_layers=(15, 16, 16, 16, 16, 16, 16, 15),
        note="32 micro-batches of 1, seq 8192; torchtitan's generated split (generate_split_points: the "
        "first stage layers // stages, the middle ones one more while extras remain); published with "
        "torch.compile + Float8 + async TP, predicted in bf16 without them",
    ),
    Run(
        name="Llama 3.1 405B, PP 8 x TP 8 x FSDP 8, interleaved 1F1B, full AC",
        source="torchtitan Table 5",
        preset="h100_8x8",
        nodes=64,
        config=LLAMA_405B,
        layout=Layout(8, 8, 1, 8, "interleaved_1f1b", 2, 32, ("always",) * 16),
        sequence_parallel=True,
        global_batch=256,
        seq_len=8192,
        published=128,
        published_text="128 tok/s/GPU",
        stage_layers=(7, *(8,) * 14, 7),
        note="2 stages per rank: torchtitan's default for a looped schedule without split points (the "
        "table does not say); otherwise as the 1F1B row",
    ),
    Run(
        name="Llama 3.1 405B, TP 8 x FSDP 16, local batch 2, full AC, bf16",
        source="torchtitan performance.md (2024)",
        preset="h100_8x8",
        nodes=16,
        config=LLAMA_405B,
        layout=Layout(1, 8, 1, 16, "gpipe", 1, 1, ("always",)),
        sequence_parallel=True,
        global_batch=32,
        seq_len=8192,
        published=109,
        published_text="109 tok/s/GPU (29.0% MFU)",
        reshard=True,
        note="128 H100 (95GB), no Float8, no torch.compile (the table's 'None' row); seq 8192, which its "
        "29.0% MFU implies; reshard after forward (torchtitan's default without PP)",
    ),
    megatron("1.7B", 2304, 24, 24, 1, 1, 32, 512, 137, fit=True),
    megatron("3.6B", 3072, 32, 30, 2, 1, 64, 512, 138),
    megatron("18.4B", 6144, 48, 40, 8, 1, 256, 1024, 135),
    megatron("39.1B", 8192, 64, 48, 8, 2, 512, 1536, 138),
    megatron("145.6B", 12288, 96, 80, 8, 8, 1536, 2304, 148),
]


def costs_of(run: Run) -> ModelCosts:
    m = model_costs_from_config(run.config, seq_len=run.seq_len, precision="bf16-mixed")
    if not run.torchtitan_sac:
        return m
    # torchtitan's op-level policy saves every second matmul's output: of a Llama layer's q, k, v, o,
    # gate, up, down (in that order) it recomputes q, v, gate and down, and keeps the attention.
    c = run.config
    h, ffn = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    recomputed = 2 * h * h + 2 * h * kv + 2 * 2 * h * ffn
    return replace(m, selective_share=recomputed / m.layer_flops[0])


def cluster_of(run: Run, efficiency: Optional[float] = None) -> Cluster:
    c = replace(cluster(run.preset), nodes=run.nodes)
    return c if efficiency is None else with_efficiency(c, efficiency)


def predict(run: Run, efficiency: Optional[float] = None) -> StepEstimate:
    return estimate(
        run.layout,
        costs_of(run),
        cluster_of(run, efficiency),
        global_batch=run.global_batch,
        seq_len=run.seq_len,
        precision="bf16-mixed",
        reshard_after_forward=run.reshard,
        stage_layers=run.stage_layers,
    )


def fitted(run: Run) -> float:
    """The efficiency at which the run's prediction equals its published throughput (bisection)."""
    return bisect_efficiency(lambda e: predict(run, e).tokens_per_s_per_device < run.published, low=0.05)


def table() -> str:
    lines = [
        "| run | source | published | published tok/s/GPU | predicted tok/s/GPU | predicted / published "
        "| predicted MFU | bubble | exposed comm | recompute |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in RUNS:
        e = predict(run)
        ratio = e.tokens_per_s_per_device / run.published
        mark = " (fit)" if run.fit else ""
        lines.append(
            f"| {run.name} | {run.source} | {run.published_text} | {run.published:,.0f} | "
            f"{e.tokens_per_s_per_device:,.0f} | {ratio:.2f}{mark} | {e.mfu:.1%} | "
            f"{e.bubble_s / e.step_s:.1%} | {e.exposed_comm_s / e.step_s:.1%} | "
            f"{e.recompute_s / e.step_s:.1%} |"
        )
    lines.append("")
    lines.extend(f"- {run.name}: {run.note}" for run in RUNS if run.note)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="print the efficiency each fit row implies")
    args = parser.parse_args()
    began = time.time()
    if args.fit:
        for run in RUNS:
            if run.fit:
                print(f"{run.preset}: efficiency {fitted(run):.4f} fits {run.name} ({run.source})")
    print(table())
    for preset in sorted({r.preset for r in RUNS}):
        d = cluster(preset).device
        print(f"\n{preset}: {d.name}, bf16 peak {d.peak_flops['bf16-mixed'] / 1e12:.1f} TFLOP/s, "
              f"efficiency {d.efficiency}")  # fmt: skip
    print(f"\n({time.time() - began:.1f} s)")


if __name__ == "__main__":
    main()
