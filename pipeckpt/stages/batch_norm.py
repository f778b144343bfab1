"""Batch statistics over the whole mini-batch, not each micro-batch (``deferred_batch_norm``).

Why not plain BatchNorm: under micro-batching it would update its running statistics once per
micro-batch. torchgpipe's DeferredBatchNorm (reached through :mod:`pipeckpt._compat`) accumulates
them over the micro-batches and commits them once per mini-batch.
"""

from typing import List

from torch import nn

from pipeckpt._compat import DeferredBatchNorm, keep_buffers_out_of_state_dict

__all__: List[str] = []


def convert_deferred_batch_norm(sequential: nn.Sequential, chunks: int) -> None:
    """Swaps BatchNorm layers for torchgpipe's DeferredBatchNorm in place, which
    tracks statistics over the whole mini-batch instead of each micro-batch.
    Its accumulators are made non-persistent so checkpoints keep plain
    BatchNorm keys and stay loadable without the pipeline."""
    for i, layer in enumerate(sequential):
        sequential[i] = DeferredBatchNorm.convert_deferred_batch_norm(layer, chunks)
    for m in sequential.modules():
        if isinstance(m, DeferredBatchNorm):
            keep_buffers_out_of_state_dict(m, ["sum", "sum_squares"])
