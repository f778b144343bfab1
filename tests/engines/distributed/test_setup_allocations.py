"""What a process allocates while it makes its stages real from the meta device: its own stages'
tensors, the scratch it draws other stages' initial values into (a process replays the draws before
its own layers, one layer at a time), and bookkeeping (the generators' states it exchanges), nothing
else. A per-layer temporary the size of the layer's elements (a NaN mask of each tensor, freed at
once) was enough for glibc's heap to keep up to 208 MiB more than a process's half of 24
Linear(4096, 4096) at train start; freed memory glibc keeps shows in no tensor count, so this counts
every storage an operator creates from ``trainer.fit`` to train start. One launch of 2 real processes
(gloo on CPU, setup_allocations_worker.py beside this file): 6 Linear(256, 256) built in
``configure_model``, pp2, balance 3 + 3."""

from pathlib import Path
from typing import Any, Dict

import pytest
import support.ranks as ranks
import torch
from setup_allocations_worker import WIDTH

HERE = Path(__file__).resolve().parent
WORLD, BALANCE = 2, [3, 3]
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear's float32 weight and bias
# The generators' states (5 KiB each) that the processes exchange as pickles: rank 0's plan and
# seed, and every process's states past the initial draws. A NaN mask of one layer's weight (a
# quarter of its bytes, 64 KiB) is over it.
BOOKKEEPING = 48 * 1024


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("setup_allocations")
    return ranks.launch(
        HERE / "setup_allocations_worker.py", WORLD, [dict(balance=BALANCE)], out, within_s=240
    )


def _result(out: Path, rank: int) -> Dict[str, Any]:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


@pytest.mark.slow
def test_set_up_allocates_only_held_tensors_replay_scratch_and_bookkeeping(two_processes: Path) -> None:
    for rank in range(WORLD):
        created = _result(two_processes, rank)["created"]
        held = sum(c["bytes"] for c in created if c["held"])
        assert held == BALANCE[rank] * LAYER_BYTES, created
        scratch = sum(BALANCE[:rank]) * LAYER_BYTES  # the earlier stages' layers, drawn and dropped
        freed = sum(c["bytes"] for c in created if not c["held"])
        assert scratch <= freed <= scratch + BOOKKEEPING, [c for c in created if not c["held"]]
