"""Gradient accumulation under the distributed engine holds one copy of the gradients.

The schedule runs forward and backward inside ``training_step``, before Lightning zeroes ``.grad``
(between ``training_step`` and ``backward``). At the first batch of an accumulation window the
engine drops the previous step's gradients before the schedule instead of holding them beside the
step's own; inside a window it keeps them and adds. Two real gloo processes (tests/
distributed_gradients_worker.py) train the toy module with ``accumulate_grad_batches=2`` for two
optimizer steps (batches 0-3) and report, per batch, the bytes of the batch's starting ``.grad``
still alive while the schedule runs; the parameters are compared with the local engine's.
"""

import json
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator

import pytest
import support.ranks as ranks
import torch
from distributed_gradients_worker import OwnZeroGrad, ZeroingModule
from support.toy import ToyModule, fit, max_relative_difference, params, toy_layers

from pipeckpt import PipelineStrategy
from pipeckpt.stages.gradients import gradients_set_aside, window_starts
from pipeckpt.state import sharded

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_gradients_worker.py"
START_S = 300  # five short trainings in two processes on a loaded 2-core machine
BALANCE = [3, 3]
WINDOW = dict(accumulate_grad_batches=2, steps=2)
RUNS = [
    dict(
        name="gpipe_clip", strategy=dict(balance=BALANCE, chunks=4, schedule="gpipe"), gradient_clip_val=0.05
    ),
    # Two epochs of two windows, a checkpoint after each epoch.
    dict(name="1f1b", strategy=dict(balance=BALANCE, chunks=4, schedule="1f1b"), checkpoint_every=2, steps=4),
    dict(
        name="in_place_zero",
        strategy=dict(balance=BALANCE, chunks=4, schedule="1f1b"),
        module={"in_place_zero": True},
    ),
    dict(
        name="own_zero_grad",
        strategy=dict(balance=BALANCE, chunks=4, schedule="1f1b"),
        own_zero_grad=True,
    ),
    # From the checkpoint "1f1b" wrote after its first epoch (Lightning resumes a plain DataLoader
    # exactly at an epoch's end): the next window's first batch.
    dict(
        name="resumed",
        strategy=dict(balance=BALANCE, chunks=4, schedule="1f1b"),
        resume_from="1f1b/epoch=0-step=2.ckpt",
        steps=4,
    ),
]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    runs = [{**WINDOW, **r} for r in RUNS]
    yield ranks.launch(WORKER, 2, runs, tmp_path_factory.mktemp("gradients"), within_s=START_S)


def _held(out: Path, name: str, rank: int) -> Dict[int, int]:
    """Bytes held per batch of the first epoch (4 batches: two windows)."""
    held = json.loads((out / f"{name}.rank{rank}.json").read_text())["held"]
    return {int(k[2:]): v for k, v in held.items() if k.startswith("0:")}


def _state(path: Path) -> Dict[str, torch.Tensor]:
    single = path.parent / f"{path.name}.pt"
    sharded.to_torch_save(path, single)
    return torch.load(single, map_location="cpu", weights_only=False)["state_dict"]


def _rank_param_bytes(rank: int) -> int:
    """fp32 bytes of the parameters of the layers rank ``rank`` holds under BALANCE."""
    layers = list(toy_layers())
    start = sum(BALANCE[:rank])
    return 4 * sum(p.numel() for layer in layers[start : start + BALANCE[rank]] for p in layer.parameters())


def _local(module: Any, **kwargs: Any) -> Dict[str, torch.Tensor]:
    trainer = fit(
        module, PipelineStrategy(balance=BALANCE, chunks=4), steps=2, accumulate_grad_batches=2, **kwargs
    )
    return params(trainer.lightning_module)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", ["gpipe_clip", "1f1b", "in_place_zero"])
def test_previous_gradients_are_gone_during_the_schedule_at_a_windows_first_batch(out, name, rank):
    held = _held(out, name, rank)
    assert held[0] == 0 and held[2] == 0, held  # batch 2 opens the second window


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", ["gpipe_clip", "1f1b", "in_place_zero"])
def test_inside_a_window_the_previous_gradients_stay_to_be_added_to(out, name, rank):
    held = _held(out, name, rank)
    assert held[1] == held[3] == _rank_param_bytes(rank), held


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_module_with_its_own_optimizer_zero_grad_keeps_its_gradients_through_the_schedule(out, rank):
    # The engine cannot know what the override zeroes, so it drops nothing.
    held = _held(out, "own_zero_grad", rank)
    assert held == {0: 0, 1: _rank_param_bytes(rank), 2: _rank_param_bytes(rank), 3: _rank_param_bytes(rank)}


@pytest.mark.slow
def test_a_window_of_two_with_clipping_trains_like_the_local_engine(out):
    reference = _local(ToyModule(), gradient_clip_val=0.05)
    assert max_relative_difference(_state(out / "gpipe_clip.ckpt"), reference) < 1e-5


@pytest.mark.slow
def test_an_optimizer_that_zeroes_in_place_trains_like_the_local_engine(out):
    reference = _local(ZeroingModule(in_place_zero=True))
    assert max_relative_difference(_state(out / "in_place_zero.ckpt"), reference) < 1e-5


@pytest.mark.slow
def test_an_own_optimizer_zero_grad_trains_like_the_local_engine(out):
    reference = _local(OwnZeroGrad())
    assert max_relative_difference(_state(out / "own_zero_grad.ckpt"), reference) < 1e-5


@pytest.mark.slow
def test_resuming_at_a_windows_first_batch_trains_like_the_uninterrupted_run(out):
    got, uninterrupted = _state(out / "resumed.ckpt"), _state(out / "1f1b.ckpt")
    assert max_relative_difference(got, uninterrupted) < 1e-5
    held = json.loads((out / "resumed.rank0.json").read_text())["held"]
    assert held == {"1:0": 0, "1:1": _rank_param_bytes(0), "1:2": 0, "1:3": _rank_param_bytes(0)}


# -- the parts, in one process ---------------------------------------------------------------


@pytest.mark.parametrize(
    "batch_idx, accumulate, starts", [(0, 1, True), (3, 1, True), (0, 2, True), (1, 2, False), (4, 2, True)]
)
def test_a_window_starts_where_lightning_zeroes_the_gradients(batch_idx, accumulate, starts):
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_idx=batch_idx)),
        accumulate_grad_batches=accumulate,
    )
    assert window_starts(trainer) is starts


def test_dropped_gradients_are_gone_within_and_after_and_the_others_come_back():
    kept, dropped = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    old_kept, old_dropped = torch.full((2,), 5.0), torch.full((3,), 7.0)
    kept.grad, dropped.grad = old_kept, old_dropped
    alive = weakref.ref(old_dropped)
    del old_dropped
    with gradients_set_aside([kept, dropped], drop=[dropped]) as computed:
        assert kept.grad is None and dropped.grad is None
        assert alive() is None  # not held aside
        (kept.sum() + 2 * dropped.sum()).backward()
    assert kept.grad is old_kept and dropped.grad is None
    assert [(p is q, g.tolist()) for (p, g), q in zip(computed, [kept, dropped])] == [
        (True, [1.0, 1.0]),
        (True, [2.0, 2.0, 2.0]),
    ]
