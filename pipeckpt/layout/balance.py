"""Stages cut by time: each stage's layers chosen so that the slowest stage is as fast as it can be.

Why beside the engine's default: the engine cuts by parameters (``balance_by='params'``), which gives
every stage of a ``pipeline_of`` model as many blocks, while the last stage also runs the head
(``2 h V`` FLOPs a token: Llama 3.1 8B's is 1.8 of its blocks at 8,192 tokens) and the first the
embedding (a lookup). A pipeline runs at its slowest stage's pace, so a cut by each layer's forward
FLOPs, the head's counted with the last layer, can take that stage's excess away. It costs memory
where it moves layers: a stage that takes one more holds its activations for every micro-batch in
flight, most on the first stage under 1F1B. So the search fits and prices both cuts
(:func:`with_time_cuts`), and ranks them as it ranks any two layouts.
"""

import functools
from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

from pipeckpt.layout.candidates import Candidate
from pipeckpt.layout.cost import balance
from pipeckpt.layout.model_costs import ModelCosts
from pipeckpt.stages.partition import min_max_partition

__all__ = ["by_time", "with_time_cuts"]


def by_time(model: ModelCosts, stages: int) -> Tuple[int, ...]:
    """Layers per stage with the largest stage's forward FLOPs a token as small as they can be: each
    layer's own (its attention at the model's sequence length), the head's with the last layer."""
    costs = list(model.layer_flops)
    costs[-1] += model.head_flops
    return _cut(tuple(max(1, round(c)) for c in costs), stages)


@functools.lru_cache(maxsize=256)
def _cut(costs: Tuple[int, ...], stages: int) -> Tuple[int, ...]:
    return tuple(min_max_partition(costs, stages))


def with_time_cuts(found: Sequence[Candidate], model: ModelCosts) -> List[Candidate]:
    """``found`` and, after each layout of several stages with the engine's default cut and one
    stage a rank, the same layout cut by time (:func:`by_time`) where that cut differs.

    Not a looped layout: its ranks hold several stages each (a V-shaped one the first and the last
    on rank 0), so the cut that makes the slowest *stage* fastest is not the one that makes the
    slowest *rank* fastest. Measured here (benchmarks/RESULTS_layout.md, "Stages cut by time"), the
    HF Llama's DualPipeV cut so was ranked first at 803 ms and ran in 1,036 ms, 1.30x the best."""
    differs: Dict[int, Tuple[int, ...]] = {}
    out: List[Candidate] = []
    for c in found:
        out.append(c)
        if c.stages < 2 or c.balance or c.virtual_stages > 1:
            continue
        if c.stages not in differs:
            timed = by_time(model, c.stages)
            differs[c.stages] = timed if timed != balance(model, c.stages) else ()
        if differs[c.stages]:
            out.append(replace(c, balance=differs[c.stages]))
    return out
