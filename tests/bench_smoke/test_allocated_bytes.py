"""The CPU allocator's count of a step (benchmarks/harness/allocated_bytes.py) beside the count of
aten-level operators (harness.live_bytes): on plain tensors they agree; on DTensors the allocator
also sees the local tensors DTensor's handlers make for an operator, which the operator count cannot
(a ``TorchDispatchMode`` is off while its own handler runs). Rank 0 of a fake world of 2: the
collectives return at once, the allocations are real."""

from typing import Callable, Tuple

import pytest
import torch
from harness.allocated_bytes import SENTINELS, AllocatedBytes, peak_between
from harness.layout_fit import ShardBytes
from support.fake_world import fake_world
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

ROWS, VOCAB = 64, 1024  # a logits shard: 64 x 512 fp32 = 128 KiB
S0, S1 = SENTINELS


def test_the_peak_is_counted_above_the_level_after_the_first_sentinel_until_the_second() -> None:
    events = [(0, 100), (1, S0), (2, -S0), (3, 50), (4, 70), (5, -50), (6, S1), (7, -S1), (8, 1000)]
    assert peak_between(events) == 120


def test_a_step_whose_sentinels_were_not_both_seen_is_refused() -> None:
    with pytest.raises(RuntimeError, match="sentinels"):
        peak_between([(0, S0), (1, -S0), (2, 64)])


def _counted(step: Callable[[], None]) -> Tuple[int, int]:
    """``step``'s peak by the operator count and by the allocator, both above what was live before."""
    with AllocatedBytes() as allocated:
        allocated.mark(0)
        with ShardBytes() as live:
            step()
        allocated.mark(1)
    return live.peak, allocated.peak()


def test_on_plain_tensors_the_allocator_sees_what_the_operator_count_sees() -> None:
    x = torch.randn(ROWS, VOCAB)

    def step() -> None:
        y = x.exp()
        z = y * 2
        del y
        (z + 1).sum()

    operators, allocator = _counted(step)
    assert operators == 2 * x.nbytes + 4  # two tensors at once, then the sum's scalar
    assert 0 <= allocator - operators <= 64  # the allocator also holds the Python scalars, made tensors


def test_under_loss_parallel_the_allocator_sees_the_logits_shards_that_dtensors_handlers_make() -> None:
    """The loss backward's handler holds a zeroed shard, an ``exp`` and their sum at once, then the
    product (torch/distributed/tensor/parallel/loss.py); the operator count sees its result alone."""
    with fake_world(2) as mesh:
        logits = distribute_tensor(torch.randn(ROWS, VOCAB), mesh, [Shard(1)]).requires_grad_()
        target = torch.randint(0, VOCAB, (ROWS,))
        shard = ROWS * VOCAB // 2 * 4

        def step() -> None:
            with loss_parallel():
                torch.nn.functional.cross_entropy(logits, target).backward()

        operators, allocator = _counted(step)
    assert allocator - operators >= 2 * shard, (operators / shard, allocator / shard)
