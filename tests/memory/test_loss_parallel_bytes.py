"""A rank whose head the plan splits runs its cross-entropy under torch's ``loss_parallel``, whose
handlers hold more logits-shaped tensors at once than aten's ops (memory/loss_parallel_bytes.py).
The count of the code outside the layers keeps a second frontier as such a rank holds the bytes
(memory/outside.py); here it is held against what the CPU allocator saw rank 0 of a fake world of
2 hold for the same loss on a vocabulary-sharded DTensor (benchmarks/harness/allocated_bytes.py).
Both above what was live before the loss: the logits."""

import torch
from harness.allocated_bytes import AllocatedBytes
from support.fake_world import fake_world
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from pipeckpt.memory.outside import _Live, peak_over

N, V, HIDDEN = 64, 1024, 16
SHARD = N * V // 2 * 4  # one rank's logits: 128 KiB
SMALL = 4096  # the loss's own small tensors (targets, masks, scalars), which the two counts see apart


def _counted(frontier: str) -> int:
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(0))
    logits = torch.randn(N, V, requires_grad=True)
    live = _Live([logits], [], head_shape=(V, HIDDEN))
    with live:
        torch.nn.functional.cross_entropy(logits, target).backward()
    return peak_over(getattr(live, frontier).above(0, 0), 2)


def _held() -> int:
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(0))
    with fake_world(2) as mesh:
        logits = distribute_tensor(torch.randn(N, V), mesh, [Shard(1)]).requires_grad_()
        with AllocatedBytes() as allocated:
            allocated.mark(0)
            with loss_parallel():
                torch.nn.functional.cross_entropy(logits, target).backward()
            allocated.mark(1)
    return allocated.peak()


def test_the_split_count_of_a_loss_is_what_loss_parallel_held_on_one_rank() -> None:
    held = _held()
    assert held // SHARD == 4  # the log-probabilities, a zeroed tensor, an exp's sum and a product
    assert abs(_counted("split") - held) <= SMALL


def test_aten_s_ops_split_over_the_vocabulary_would_count_a_shard_less() -> None:
    assert _held() - _counted("frontier") >= SHARD - SMALL
