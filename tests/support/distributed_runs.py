"""The distributed engine's runs against the local engine, which
tests/engines/distributed/test_distributed_engine*.py start and read: the worker, the fixture that
launches a group of trainings in one start, reading a checkpoint back as one dict, and the layouts
every schedule is proven on.

Each run names its distributed settings, the local engine's equivalent on the same stages and
micro-batches (no dropout), and the toy's depth; a test compares the parameters both trained.
"""

from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch

from pipeckpt import PipelineStrategy
from pipeckpt.state import sharded
from support import ranks
from support.paths import TESTS

WORKER = TESTS / "engines" / "distributed" / "distributed_worker.py"
START_S = 240  # a group of trainings, processes started on a loaded 2-core machine


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Iterator[Any]:
    """``launch(world, runs)`` starts ``world`` ranks of :data:`WORKER` on ``runs`` and returns the folder
    they wrote; a test file imports it to launch its group of trainings once (module scope)."""

    def run(world: int, runs: List[Dict[str, Any]]) -> Path:
        return ranks.launch(WORKER, world, runs, tmp_path_factory.mktemp(f"world{world}"), within_s=START_S)

    yield run


def checkpoint_state(path: Path) -> Dict[str, Any]:
    """A checkpoint as one dict: the distributed engine writes a sharded directory, which
    the converter turns into the single file the local engine writes."""
    if sharded.is_sharded(path):
        single = path.parent / f"{path.name}.pt"
        sharded.to_torch_save(path, single)
        path = single
    return torch.load(path, map_location="cpu", weights_only=False)


def local_strategy(**kwargs: Any) -> PipelineStrategy:
    return PipelineStrategy(**kwargs)


TWO = [  # name, distributed settings, the local engine's equivalent, depth
    (
        "gpipe",
        dict(balance=[3, 3], chunks=4, schedule="gpipe", checkpoint="except_last"),
        dict(balance=[3, 3], chunks=4, checkpoint="except_last"),
        6,
    ),
    (
        "1f1b_mix",
        dict(balance=[3, 3], chunks=4, schedule="1f1b", checkpoint=["always", "except_last"]),
        dict(balance=[3, 3], chunks=4, checkpoint=["always", "except_last"]),
        6,
    ),
    (
        "interleaved_mix",
        dict(
            balance=[2, 1, 1, 2],
            chunks=4,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            checkpoint=["never", "always", "except_last", "offload"],
        ),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint=["never", "always", "except_last", "offload"]),
        6,
    ),
    (
        "looped_bfs_mix",
        dict(
            balance=[2, 1, 1, 2],
            chunks=4,
            schedule="looped_bfs",
            virtual_stages=2,
            checkpoint=["always", "never", "offload", "except_last"],
        ),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint=["always", "never", "offload", "except_last"]),
        6,
    ),
    # Zero-bubble schedules split backward into input and weight passes: checkpoint "never" only.
    (
        "interleaved_zero_bubble",
        dict(
            balance=[2, 1, 1, 2],
            chunks=4,
            schedule="InterleavedZeroBubble",
            virtual_stages=2,
            checkpoint="never",
        ),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint="never"),
        6,
    ),
    (
        "zbv_zero_bubble",
        dict(
            balance=[2, 1, 1, 2], chunks=4, schedule="zbv_zero_bubble", virtual_stages=2, checkpoint="never"
        ),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint="never"),
        6,
    ),
    (
        "dual_pipe_v",
        dict(balance=[2, 1, 1, 2], chunks=4, schedule="DualPipeV", virtual_stages=2, checkpoint="never"),
        dict(balance=[2, 1, 1, 2], chunks=4, checkpoint="never"),
        6,
    ),
]
FOUR = [
    (
        "pp4_1f1b_mix",
        dict(
            balance=[2, 2, 1, 1],
            chunks=4,
            schedule="1f1b",
            checkpoint=["always", "never", "except_last", "always"],
        ),
        dict(balance=[2, 2, 1, 1], chunks=4, checkpoint=["always", "never", "except_last", "always"]),
        6,
    ),
    (
        "pp4_interleaved",
        dict(
            balance=[1] * 8, chunks=4, schedule="interleaved_1f1b", virtual_stages=2, checkpoint="except_last"
        ),
        dict(balance=[1] * 8, chunks=4, checkpoint="except_last"),
        8,
    ),
    # Looped schedules on two replicas: a zero-bubble one's averaged after the step (under DDP,
    # whose reducer its split backward never ran, each replica trained on its half alone), kept
    # and recomputed; an interleaved one's under DDP.
    *(
        (
            f"dp2_{schedule}_{mode}",
            dict(balance=[2, 1, 1, 2], chunks=4, schedule=schedule, virtual_stages=2, dp=2, checkpoint=mode),
            dict(balance=[2, 1, 1, 2], chunks=4, checkpoint=mode),
            6,
        )
        for schedule, mode in [
            ("zbv_zero_bubble", "never"),
            ("zbv_zero_bubble", "always"),
            ("interleaved_zero_bubble", "except_last"),
            ("interleaved_1f1b", "never"),
        ]
    ),
    # Two replicas of a 2-stage pipeline, each on half of every batch, against one pipeline on all of it.
    ("dp2_pp2", dict(balance=[3, 3], chunks=4, schedule="1f1b", dp=2), dict(balance=[3, 3], chunks=4), 6),
]
STEPS = 4
# a zero-bubble schedule on two replicas (averaged after the step), over batches accumulated and clipped
ZBV_ON_REPLICAS = dict(
    name="dp2_zbv_accumulate_clip",
    strategy=dict(balance=[2, 1, 1, 2], chunks=4, schedule="zbv_zero_bubble", virtual_stages=2, dp=2),
    depth=6,
)
# Every schedule that can recompute, with dropout on: a mode mix must not change one bit.
DROPOUT = {
    "gpipe": dict(balance=[3, 3], chunks=4, schedule="gpipe"),
    "1f1b": dict(balance=[3, 3], chunks=4, schedule="1f1b"),
    "interleaved_1f1b": dict(balance=[2, 1, 1, 2], chunks=4, schedule="interleaved_1f1b", virtual_stages=2),
    "looped_bfs": dict(balance=[2, 1, 1, 2], chunks=4, schedule="looped_bfs", virtual_stages=2),
}
MIX = {2: ["always", "except_last"], 4: ["offload", "always", "except_last", "never"]}
