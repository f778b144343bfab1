"""What tensor parallelism costs a layer on this machine, measured between real processes for
``cluster=local``.

Why measured, and between processes: on a CPU a layer that ``tensor_parallel_plan`` splits does not
run in ``1 / tp`` of its time. Its split modules run on DTensors, whose dispatch costs the host the
same whatever the size, and what the plan leaves whole (norms, residual adds, the redistributions
between placements) runs on every rank at full size. Timed on an HF Llama of hidden 256 with 2
gloo processes of one thread each (2026-12-02, this project's 2-core Xeon, other work running), a
split layer took 1.02x the unsplit layer's time at 8 samples and 0.89x at 16, where the cost model
had said 0.5x plus the all-reduces: every tensor-parallel layout was predicted far faster than it
measured. A world of one process (this module's first version) showed the dispatch alone.

So the model is split by its own plan over ``tp`` real processes and timed beside the unsplit model
at two micro-batch sizes, every process running at once as in a layout. Per layer the split's time
is fitted as ``slope x whole + host``: the slope gives the share of the layer ``tp`` does not divide
(``TensorParallelCosts.unsplit``, pipeckpt/layout/model_costs.py), the intercept the host's fixed
seconds. The all-reduces the cost model counts apart are taken out first, so nothing is counted
twice. The same is fitted for the code outside the layers (embedding, head and loss, split over the
vocabulary).
"""

import statistics
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeckpt.engines.distributed.tensor_parallel import TensorParallel
from pipeckpt.layout.model_costs import TensorParallelCosts
from pipeckpt.plan_model import batch, built, joined, profiled
from pipeckpt.plan_spawn import handed_back, spawned

__all__ = ["Times", "fit", "split", "timed_pair"]

Times = Dict[
    str, List[float]
]  # "<whole|split> <microbatch>" -> [layers fwd, layers bwd, outside fwd, outside bwd]


def split(layers: Sequence[nn.Module], plan: Sequence[Tuple[str, str]], mesh: DeviceMesh) -> None:
    """``layers`` split in place by ``plan`` over ``mesh``, as the distributed engine splits them."""
    TensorParallel(mesh, dict(plan)).split(list(layers))


def timed_pair(
    cfg: DictConfig, plan: Sequence[Tuple[str, str]], tp: int, microbatches: Sequence[int], rounds: int = 2
) -> Times:
    """The model of ``cfg`` timed unsplit and split by ``plan`` over ``tp`` gloo processes started for
    it (spawned, so that nothing of this process's state is shared), at each of ``microbatches``,
    rounds interleaved: per kind and size, the medians over rounds of the layers' mean forward and
    backward seconds and the outside code's. A failing process raises its own error."""
    plain = OmegaConf.to_container(cfg)  # a structured config does not pickle; kept unresolved
    args = (tp, plain, tuple(plan), tuple(microbatches), rounds, torch.get_default_dtype())
    times: Times = spawned(_worker, args, tp)
    return times


def _worker(
    rank: int,
    tp: int,
    plain: Dict[str, Any],
    plan: Tuple[Tuple[str, str], ...],
    microbatches: Tuple[int, ...],
    rounds: int,
    dtype: torch.dtype,
    scratch: str,
    out: str,
) -> None:
    cfg = joined(rank, tp, plain, dtype, scratch)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))["tp"]
        drawn = batch(cfg)
        seen: Dict[str, List[List[float]]] = {}
        with built(cfg, drawn, fake=False) as whole, built(cfg, drawn, fake=False) as parted:
            split(list(parted.sequential), plan, mesh)
            for _ in range(rounds):
                for m in microbatches:
                    for kind, b in (("whole", whole), ("split", parted)):
                        dist.barrier()  # every process times the same thing at once
                        p = profiled(cfg, b, m, fake=False)
                        n = len(p.layers)
                        loss = p.loss
                        seen.setdefault(f"{kind} {m}", []).append(
                            [
                                sum(x.forward_s for x in p.layers) / n,
                                sum(x.backward_s for x in p.layers) / n,
                                loss.forward_s if loss is not None else 0.0,
                                loss.backward_s if loss is not None else 0.0,
                            ]
                        )
        handed_back(
            rank, out, {k: [statistics.median(col) for col in zip(*v, strict=True)] for k, v in seen.items()}
        )
    finally:
        dist.destroy_process_group()


def fit(
    times: Times, tp: int, microbatches: Tuple[int, int], layer_comm_s: Callable[[int], float]
) -> TensorParallelCosts:
    """:class:`TensorParallelCosts` from :func:`timed_pair`'s times at two micro-batch sizes, less
    ``layer_comm_s(m)``: the all-reduce seconds the cost model counts apart in one layer's forward
    (and as many in its backward) at ``m`` samples. The share is clamped to [0, 1] and the host's
    seconds to at least 0 (timing noise)."""
    small, large = microbatches

    def line(index: int, comm: Callable[[int], float]) -> Tuple[float, float, float]:
        """The share ``tp`` leaves whole, and the fixed seconds of forward and backward."""
        w = {m: times[f"whole {m}"] for m in (small, large)}
        s = {
            m: [times[f"split {m}"][i] - (comm(m) if i < 2 else 0.0) for i in range(4)]
            for m in (small, large)
        }
        pair = (index, index + 1)
        grow_w = sum(w[large][i] - w[small][i] for i in pair)
        grow_s = sum(s[large][i] - s[small][i] for i in pair)
        slope = min(1.0, max(1.0 / tp, grow_s / grow_w)) if grow_w > 0 else 1.0 / tp
        unsplit = (slope - 1.0 / tp) / (1.0 - 1.0 / tp)
        host = [max(0.0, statistics.mean(s[m][i] - slope * w[m][i] for m in (small, large))) for i in pair]
        return unsplit, host[0], host[1]

    unsplit, forward, backward = line(0, layer_comm_s)
    head_unsplit, head_forward, head_backward = line(2, lambda m: 0.0)
    return TensorParallelCosts(unsplit, (forward, backward), head_unsplit, (head_forward, head_backward))
