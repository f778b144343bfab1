"""What FSDP2 costs the host on this machine beyond its collectives, measured between real processes
for ``cluster=local``.

Why measured: the cost model priced FSDP by its collectives' bytes alone, and on a CPU that is the
smaller part. On the app's GPT at pp1 x dp2 (2026-12-03, this project's 2-core Xeon) FSDP measured
+153 ms a step over plain data parallelism where the bytes priced +38 ms; ``torch.profiler`` put
the rest in DTensor's dispatch (the optimizer's step and FSDP2's hooks), FSDP2's copies into and out
of its flat buffers, and AdamW on DTensors. None of it has a datasheet figure, and all of it is the
host's, so it is timed, as :mod:`pipeckpt.plan_tp_host` times a tensor-parallel split.

How: in 2 spawned gloo processes (the least shard degree a layout takes), a training step (the
module's own ``training_step`` and backward on every micro-batch, then AdamW) is timed on the model
sharded as the engine shards a stage (one ``fully_shard`` unit per layer that trains, the module
their root; parameters gathered once a step; gradients synchronised and resharded after the last
micro-batch only, as torch's ``PipelineStage`` sets FSDP2's flags) beside the same step under DDP
(``no_sync`` before the last micro-batch), on one micro-batch and on two of half its size, rounds
interleaved. The difference, less what the cost model prices apart (FSDP's all-gather and
reduce-scatter over DDP's all-reduce), averaged over the two, is FSDP's host seconds a step, spread
over the layers it shards. It did not grow with the micro-batches beyond the measurement's own
noise (:class:`~pipeckpt.layout.model_costs.FsdpHostCosts`), so no term per micro-batch is fitted;
the second step halves the noise of the one that is.
"""

import statistics
import time
import warnings
from contextlib import nullcontext
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from pipeckpt.layout.model_costs import FsdpHostCosts
from pipeckpt.plan_model import Built, batch, built, joined
from pipeckpt.plan_spawn import handed_back, spawned

__all__ = ["SHARDS", "Times", "fit", "timed", "units"]

#: The processes the measurement runs on: the least shard degree a layout takes.
SHARDS = 2

Times = Dict[str, float]  # "<whole|sharded> <micro-batches>" -> the step's median wall seconds (whole: DDP)


def timed(cfg: DictConfig, samples: int, rounds: int = 6) -> Times:
    """A training step of the model of ``cfg`` on ``samples`` samples, under DDP ("whole") and
    sharded by FSDP2 ("sharded"), on one micro-batch and on two of half as many samples, over
    :data:`SHARDS` gloo processes started for it (spawned: nothing of this process's state is
    shared), rounds interleaved: the medians of the step's wall seconds (every process starts and
    ends the step together). A failing process raises its own error."""
    plain = OmegaConf.to_container(cfg)  # a structured config does not pickle; kept unresolved
    times: Times = spawned(_worker, (plain, samples, rounds, torch.get_default_dtype()), SHARDS)
    return times


def _worker(
    rank: int, plain: Dict[str, Any], samples: int, rounds: int, dtype: torch.dtype, scratch: str, out: str
) -> None:
    warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step without a Trainer
    cfg = joined(rank, SHARDS, plain, dtype, scratch)
    try:
        mesh = init_device_mesh("cpu", (SHARDS,))
        drawn = batch(cfg)
        size = int(cfg.data.batch_size)
        # one micro-batch of ``samples``, or two of half as many: the same step's samples either way
        firsts = {m: _first(drawn, max(1, m * size // samples)) for m in (1, 2)}
        seen: Dict[str, List[float]] = {}
        with built(cfg, drawn, fake=False) as whole, built(cfg, drawn, fake=False) as parted:
            for layer in filter(_trains, parted.sequential):
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
            # the step the root, as the engine makes its stage: one root's hooks a backward, and
            # what is left outside the layers sharded with it, gathered whatever the step calls (a
            # user's training_step that calls its model's submodule, not its own forward)
            stepped = _Steps(parted.module)
            root = fully_shard(stepped, mesh=mesh, reshard_after_forward=False)
            replicated = DistributedDataParallel(_Steps(whole.module))
            kinds = {
                "whole": (replicated, _optimizers(whole), None),
                "sharded": (stepped, _optimizers(parted), root),
            }
            for r in range(rounds + 1):  # the first round warms up
                for m in (1, 2):
                    for kind, (steps, optimizers, sharded) in kinds.items():
                        dist.barrier()  # every process times the same step at once
                        t0 = time.perf_counter()
                        _step(steps, firsts[m], optimizers, sharded, m)
                        dist.barrier()
                        if r:
                            seen.setdefault(f"{kind} {m}", []).append(time.perf_counter() - t0)
        handed_back(rank, out, {k: statistics.median(v) for k, v in seen.items()})
    finally:
        dist.destroy_process_group()


def _optimizers(b: Built) -> List[torch.optim.Optimizer]:
    """AdamW over the module's parameters that train."""
    return [torch.optim.AdamW([p for p in b.module.parameters() if p.requires_grad])]


class _Steps(nn.Module):
    """A module whose call is its ``training_step``: what DDP's hooks need to see (as Lightning
    wraps a module for its strategies)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, microbatch: Any) -> Tensor:
        loss = self.module.training_step(microbatch, 0)  # type: ignore[operator]
        return loss["loss"] if isinstance(loss, dict) else loss


def _step(
    steps: nn.Module,
    microbatch: Any,
    optimizers: Sequence[torch.optim.Optimizer],
    root: Optional[FSDPModule],
    microbatches: int,
) -> None:
    """One optimizer step: every micro-batch's forward and backward, gradients synchronised on the
    last (FSDP's flags as torch's PipelineStage sets them; DDP's ``no_sync`` before it), then AdamW."""
    for i in range(microbatches):
        last = i == microbatches - 1
        if root is not None:
            root.set_requires_gradient_sync(last)
            root.set_reshard_after_backward(last)
            root.set_is_last_backward(last)
        quiet = steps.no_sync() if isinstance(steps, DistributedDataParallel) and not last else nullcontext()
        with quiet:
            steps(microbatch).backward()
    for o in optimizers:
        o.step()
        o.zero_grad()


def _first(drawn: Any, chunks: int) -> Any:
    """The first of ``chunks`` micro-batches of a batch as the data module gives it (tensors cut
    along dimension 0, in tuples, lists and dicts)."""
    if isinstance(drawn, torch.Tensor):
        return drawn.chunk(chunks)[0]
    if isinstance(drawn, dict):
        return {k: _first(v, chunks) for k, v in drawn.items()}
    if isinstance(drawn, (tuple, list)):
        return type(drawn)(_first(v, chunks) for v in drawn)
    return drawn


def units(sequential: Iterable[nn.Module]) -> int:
    """The layers FSDP shards as units of their own: those that train parameters."""
    return sum(1 for layer in sequential if _trains(layer))


def _trains(layer: nn.Module) -> bool:
    return any(p.requires_grad for p in layer.parameters())


def fit(times: Times, layers: int, comm_s: float) -> FsdpHostCosts:
    """:class:`FsdpHostCosts` per layer from :func:`timed`'s times over ``layers`` sharded layers:
    the mean over both micro-batch counts of the sharded step's seconds over DDP's, less ``comm_s``
    (what the cost model prices apart for FSDP over DDP in one step: its all-gather and
    reduce-scatter less DDP's all-reduce). Clamped to at least 0 (timing noise)."""
    extra = statistics.mean(times[f"sharded {m}"] - times[f"whole {m}"] for m in (1, 2))
    return FsdpHostCosts(step_s=max(0.0, extra - comm_s) / max(1, layers))
