"""Every schedule under every recomputing mode, on a tensor Sequential, a pytree with a side input and
a ``pipeline_of`` model: the distributed engine against the local one.

The zero-bubble schedules (``interleaved_zero_bubble``, ``zbv_zero_bubble``, ``dual_pipe_v``) split
each micro-batch's backward into an input pass and a weight pass; a stage's recompute Function splits
its own backward the same way (pipeckpt/stages/weight_pass.py), so a recomputing stage recomputes
once per micro-batch. Reference: the same module trained by the local engine on one stage with the
same ``chunks`` (dropout off; every mode is bitwise equal there). Tolerance: 1e-5 relative per
tensor (the distributed engine sums micro-batch gradients aside).

One launch of 2 real processes (gloo on CPU, distributed_zero_bubble_worker.py) runs the matrix.
"""

import itertools
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import support.ranks as ranks
import torch
from distributed_zero_bubble_worker import build
from support.toy import max_relative_difference, params
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pipeckpt import PipeckptWarning, PipelineStrategy
from pipeckpt.stages.weight_pass import input_pass

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_zero_bubble_worker.py"
START_S = 900  # the whole matrix, on a loaded 2-core machine
STEPS = 2
TOLERANCE = 1e-5
MODELS = {  # model -> balance over 2 stages, over 4 (two per process)
    "tensor": ([3, 3], [2, 1, 1, 2]),
    "pytree": ([2, 3], [2, 1, 1, 1]),
    "rooted": ([2, 2], [1, 1, 1, 1]),
}
SCHEDULES = {  # schedule -> stages per process
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "looped_bfs": 2,
    "interleaved_zero_bubble": 2,
    "zbv_zero_bubble": 2,
    "dual_pipe_v": 2,
}
ZERO_BUBBLE = ["interleaved_zero_bubble", "zbv_zero_bubble", "dual_pipe_v"]
MODES = ["never", "always", "selective", "always:1"]
CASES = list(itertools.product(MODELS, SCHEDULES, MODES))
SHORT = 21  # batches of 16 and 5: 5 samples run as 1 or 5 micro-batches, then the batch of 16 again
SHORT_STEPS = 3


def _name(model: str, schedule: str, mode: str) -> str:
    return f"{model}-{schedule}-{mode.replace(':', '_')}"


def _strategy(model: str, schedule: str, mode: str) -> Dict[str, Any]:
    per_process = SCHEDULES[schedule]
    balance = MODELS[model][per_process - 1]
    return dict(balance=balance, chunks=4, schedule=schedule, virtual_stages=per_process, checkpoint=mode)


def _split_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 2))


def test_an_input_pass_leaves_the_weight_gradients_to_its_weight_pass():
    """The split inside a stage's Function (no processes): the input's gradient at once, the weights'
    only when the weight pass runs, both bitwise equal to one whole backward's."""
    x, grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.ones(3, 2)
    whole = _split_layers()
    inputs = x.clone().requires_grad_()
    torch.autograd.backward(whole(inputs), grad)
    split = _split_layers()
    leaf = x.clone().requires_grad_()
    weight_pass = input_pass([get_gradient_edge(split(leaf))], [grad], [leaf], list(split.parameters()))
    assert weight_pass is not None and torch.equal(leaf.grad, inputs.grad)
    assert all(p.grad is None for p in split.parameters())
    weight_pass()
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_an_input_pass_without_an_input_to_differentiate_defers_the_whole_backward():
    """The first stage sends no gradient back: its input pass does nothing, its weight pass all."""
    layers = _split_layers()
    out = layers(torch.randn(3, 4))
    weight_pass = input_pass([get_gradient_edge(out)], [torch.ones(3, 2)], [], list(layers.parameters()))
    assert weight_pass is not None and all(p.grad is None for p in layers.parameters())
    weight_pass()
    assert all(p.grad is not None for p in layers.parameters())


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Iterator[Path]:
    runs = [dict(name=_name(*case), model=case[0], strategy=_strategy(*case), steps=STEPS) for case in CASES]
    runs += [
        dict(name=f"short-{s}", model="tensor", strategy=_strategy("tensor", s, "always"), steps=SHORT_STEPS)
        for s in ZERO_BUBBLE
    ]
    for run in runs[-len(ZERO_BUBBLE) :]:
        run["samples"] = SHORT
    yield ranks.launch(WORKER, 2, runs, tmp_path_factory.mktemp("zero_bubble"), within_s=START_S)


@pytest.fixture(scope="module")
def local() -> Dict[str, Dict[str, torch.Tensor]]:
    """Each model trained by the local engine on one stage, ``chunks`` as the distributed runs."""
    out = {}
    for model in MODELS:
        module, loader = build(model)
        torch.manual_seed(123)
        strategy = PipelineStrategy(stages=1, chunks=4)
        ranks.quiet_trainer(strategy, 1, max_steps=STEPS, limit_val_batches=0).fit(module, loader)
        out[model] = params(module)
    return out


@pytest.fixture(scope="module")
def local_short() -> Dict[str, torch.Tensor]:
    module, loader = build("tensor", SHORT)
    torch.manual_seed(123)
    strategy = PipelineStrategy(stages=1, chunks=4)
    with pytest.warns(PipeckptWarning, match="a batch of 5 samples"):
        ranks.quiet_trainer(strategy, 1, max_steps=SHORT_STEPS, limit_val_batches=0).fit(module, loader)
    return params(module)


def _result(out: Path, name: str) -> Dict[str, Any]:
    """Both ranks' parameters in one dict (a copy held by both is equal after the step), and each
    stage's forward calls."""
    merged: Dict[str, Any] = {"params": {}, "forward_calls": {}, "added": {"weight": 0, "input": 0}}
    for rank in range(2):
        one = torch.load(out / f"{name}.rank{rank}.pt", weights_only=True)
        merged["params"].update(one["params"])
        merged["forward_calls"].update(one["forward_calls"])
        for where, n in one["added"].items():
            merged["added"][where] += n
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("model,schedule,mode", CASES, ids=[_name(*c) for c in CASES])
def test_every_schedule_and_mode_trains_as_the_local_engine(matrix, local, model, schedule, mode):
    trained = _result(matrix, _name(model, schedule, mode))["params"]
    assert max_relative_difference(trained, local[model]) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_a_zero_bubble_schedule_recomputes_each_microbatch_once(matrix, model, schedule):
    """Under ``always`` every stage runs each micro-batch's layers twice (forward and one recompute,
    shared by the input and the weight pass): twice what ``never`` runs."""
    never = _result(matrix, _name(model, schedule, "never"))["forward_calls"]
    always = _result(matrix, _name(model, schedule, "always"))["forward_calls"]
    assert always == {stage: 2 * calls for stage, calls in never.items()}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_a_recomputing_mode_keeps_the_weight_passes_of_never(matrix, model, schedule):
    """The bubble filling stays: ``always`` and ``always:1`` add as many parameter gradients inside
    the schedule's weight passes as ``never`` does, and some (``dual_pipe_v`` also runs whole
    backwards; a ``pipeline_of`` model's parameters outside its layers get theirs with the code
    outside the layers, in the input pass)."""
    never = _result(matrix, _name(model, schedule, "never"))["added"]
    assert never["weight"] > 0
    for mode in ["always", "always:1"]:
        assert _result(matrix, _name(model, schedule, mode))["added"] == never, mode


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_a_schedule_with_whole_backwards_has_no_weight_passes(matrix, schedule):
    for model in MODELS:
        added = _result(matrix, _name(model, schedule, "always"))["added"]
        assert added["weight"] == 0 and added["input"] > 0, (model, added)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_a_recomputing_zero_bubble_run_is_bitwise_equal_to_never(matrix, schedule):
    """Checkpointing never changes the math: on CPU the split backward of a recomputed micro-batch
    makes the same gradients, bit for bit, as that of a kept one."""
    for model in MODELS:
        never = _result(matrix, _name(model, schedule, "never"))["params"]
        for mode in MODES[1:]:
            other = _result(matrix, _name(model, schedule, mode))["params"]
            for key in never:
                assert torch.equal(other[key], never[key]), f"{model} {mode}: {key}"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_a_short_last_batch_trains_under_a_recomputing_zero_bubble_schedule(matrix, local_short, schedule):
    """A batch of 5 with ``chunks=4`` runs as fewer or more equal micro-batches (a schedule of its
    own), and the next epoch's first batch goes back to the schedule of 4, weight passes and all."""
    trained = _result(matrix, f"short-{schedule}")["params"]
    assert max_relative_difference(trained, local_short) < TOLERANCE
