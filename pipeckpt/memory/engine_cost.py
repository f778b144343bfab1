"""The engines' own seconds per micro-batch and stage: what a step costs beyond its layers' kernels
for each micro-batch more (a stage call, the hand-offs between stages, the schedule's bookkeeping).

Why a constant per engine rather than a profile: the profile times each layer's forward and backward
on one micro-batch, which no engine wraps, so without these the time model sees a step cut into more,
smaller micro-batches as free wherever the kernels' work is the same. Both are host work measured on
this project's 2-core machine (benchmarks/bench_layout_engine_cost.py); on a GPU it overlaps the
kernels it launches when they run longer, so there each is an upper bound.
"""

__all__ = ["ENGINE_S_PER_MICROBATCH", "LOCAL_ENGINE_S_PER_MICROBATCH", "engine_s_per_microbatch"]

#: The distributed engine's seconds per micro-batch and stage (its forward and backward together):
#: 2 stages on 2 gloo processes, 2026-12-02: the fastest rounds of 14 read 1.12 and 1.18 ms, the
#: median 4.1 ms with three other developers' jobs on the 2 cores (benchmarks/RESULTS_layout.md,
#: "Engine cost per micro-batch").
ENGINE_S_PER_MICROBATCH = 1.15e-3

#: The local engine's (torchgpipe, every stage on one device): ``--engine local --stages 2 4
#: --rounds 7``, 2026-12-02, CPU time: the median of the 8 medians of four runs (2 and 4 stages each,
#: 0.09 to 0.21 ms, two runs beside other jobs; benchmarks/RESULTS_hf_auto_time.md, "The engine's own
#: cost per micro-batch").
LOCAL_ENGINE_S_PER_MICROBATCH = 0.14e-3


def engine_s_per_microbatch(local: bool) -> float:
    """One stage's cost of one micro-batch more under the local engine (``local``) or the distributed one."""
    return LOCAL_ENGINE_S_PER_MICROBATCH if local else ENGINE_S_PER_MICROBATCH
