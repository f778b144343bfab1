"""The distributed engine against the unpipelined module, dropout on:
pytrees with side inputs, a weight tied across processes, skip connections across stages (a stage 0
output read on stage 3) and the two real clients pipelined with ``pipeline_of``; and forward-only steps
(validation, predict) of a pytree model and of a ``pipeline_of`` model.

With dropout on, the reference is the same module trained by the local engine on one stage with the
same ``chunks``: per-layer random streams (``layer_rng``) make every named layer's masks depend on the
seed, the training call, the micro-batch and the layer only, and the model's own code between the
layers draws from the caller's generator in micro-batch order on every rank, as on one stage.
tests/checkpointing/test_dropout_equivalence.py proves that local reference against the plain, unpipelined
module
(``layer_rng='off'``, one micro-batch). Tolerance: 1e-5 relative per tensor (the distributed engine sums
micro-batch gradients aside). Forward-only outputs are compared with the unpipelined module's directly.

One launch of 2 real processes (gloo on CPU, tests/engines/distributed/distributed_equivalence_worker.py)
runs every run.
"""

import functools
import importlib.util
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import lightning as L
import pytest
import support.ranks as ranks
import torch
from support.equivalence_models import (
    PytreeForwardModule,
    SkipsModule,
    TiedDropoutModule,
    forward_client,
    unpipelined_outputs,
)
from support.pytree_models import pytree_loader, tied_loader
from support.toy import max_relative_difference, params
from test_distributed_pytree import _state

from pipeckpt import PipelineStrategy
from pipeckpt.engines.distributed.rooted import check_module_pipeline
from pipeckpt.settings import PipeSettings

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_equivalence_worker.py"
START_S = 480  # every run below, on a loaded 2-core machine
STEPS = 2
DROPOUT = 0.2
TOLERANCE = 1e-5
TWO = dict(balance=[2, 2], chunks=4)
TIED_1F1B = dict(balance=[2, 3], chunks=4, schedule="1f1b")
FOUR = dict(balance=[1, 1, 1, 1], chunks=4, virtual_stages=2)
FIT = [  # name, model, distributed settings (2 processes); all with dropout on
    ("tied_1f1b_mix", "tied", dict(TIED_1F1B, checkpoint=["always", "never"])),
    (
        "tied_interleaved_mix",
        "tied",
        dict(
            balance=[1, 1, 1, 2],
            chunks=4,
            virtual_stages=2,
            schedule="interleaved_1f1b",
            checkpoint=["never", "always", "except_last", "offload"],
        ),
    ),
    ("pytree_1f1b_mix", "pytree", dict(TIED_1F1B, checkpoint=["except_last", "offload"])),
    (
        "skips_interleaved_mix",  # stage 0's output read by stage 3: rank 0 -> rank 1
        "skips",
        dict(FOUR, schedule="interleaved_1f1b", checkpoint=["always", "never", "offload", "except_last"]),
    ),
    ("gpt2_gpipe_mix", "gpt2", dict(TWO, schedule="gpipe", checkpoint=["except_last", "always"])),
    # split backward: every gradient in the input pass (RootStageModule.whole_backward)
    ("gpt2_zbv_zero_bubble", "gpt2", dict(FOUR, schedule="zbv_zero_bubble", checkpoint="never")),
    ("demo_dual_pipe_v", "demo", dict(FOUR, schedule="DualPipeV", checkpoint="never")),
    ("demo_1f1b_always", "demo", dict(TWO, schedule="1f1b", checkpoint="always")),
    (  # two passes of each micro-batch per rank: the positional-encoding dropout must draw alike
        "demo_interleaved_mix",
        "demo",
        dict(FOUR, schedule="interleaved_1f1b", checkpoint=["never", "always", "except_last", "always"]),
    ),
]
OFF = ["tied_1f1b_mix", "demo_1f1b_always"]  # run again with layer_rng="off": they must then differ
FORWARD = [  # name, model, distributed settings: validate and predict, untrained
    ("pytree_forward", "pytree", dict(balance=[2, 3], chunks=4, schedule="1f1b", checkpoint="always")),
    ("demo_forward", "demo", dict(TWO, schedule="gpipe", checkpoint="never")),
    ("gpt2_forward", "gpt2", dict(TWO, schedule="1f1b", checkpoint="always")),
]


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None  # an optional extra


def _available(model: str) -> bool:
    return model != "gpt2" or HAS_TRANSFORMERS


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    runs: List[Dict[str, Any]] = [
        dict(name=n, model=m, strategy=s, steps=STEPS, dropout=DROPOUT) for n, m, s in FIT
    ]
    runs += [
        dict(name=f"{n}_rng_off", model=m, strategy=dict(s, layer_rng="off"), steps=STEPS, dropout=DROPOUT)
        for n, m, s in FIT
        if n in OFF
    ]
    runs += [dict(name=n, model=m, strategy=s, action="forward", dropout=DROPOUT) for n, m, s in FORWARD]
    runs = [run for run in runs if _available(run["model"])]
    yield ranks.launch(WORKER, 2, runs, tmp_path_factory.mktemp("equivalence"), within_s=START_S)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "zbv_zero_bubble", "DualPipeV"])
@pytest.mark.parametrize("dp", [1, 2])
def test_a_module_pipeline_is_accepted_under_every_split_backward_schedule_and_with_replicas(schedule, dp):
    check_module_pipeline(
        "model", PipeSettings(engine="distributed", schedule=schedule, virtual_stages=2, dp=dp)
    )


def _one_stage(module: L.LightningModule, loader: Any) -> Dict[str, torch.Tensor]:
    """``module`` trained by the local engine on one stage, ``chunks`` as the distributed runs."""
    torch.manual_seed(123)
    ranks.quiet_trainer(PipelineStrategy(stages=1, chunks=4), 1, max_steps=STEPS).fit(module, loader)
    return params(module)


def _built(model: str) -> Tuple[L.LightningModule, Any]:
    """The module with dropout on, untrained, and its data."""
    if model == "tied":
        return TiedDropoutModule(dropout=DROPOUT), tied_loader()
    if model == "pytree":
        return PytreeForwardModule(dropout=DROPOUT), pytree_loader()
    if model == "skips":
        return SkipsModule(dropout=DROPOUT), pytree_loader()
    return forward_client(model, dropout=DROPOUT)


def _untrained(model: str) -> Dict[str, torch.Tensor]:
    return params(_built(model)[0])


@functools.cache
def _reference(model: str) -> Dict[str, torch.Tensor]:
    return _one_stage(*_built(model))


@pytest.mark.slow
@pytest.mark.parametrize("name, model, settings", FIT, ids=[f[0] for f in FIT])
def test_with_dropout_on_training_across_two_processes_matches_one_local_stage(
    two_processes, name, model, settings
):
    if not _available(model):
        pytest.skip("transformers is not installed")
    got = _state(two_processes / f"{name}.ckpt")["state_dict"]
    reference = _reference(model)
    assert sorted(got) == sorted(reference)  # the module's own keys, a tied weight's both names
    assert max_relative_difference(got, reference) < TOLERANCE
    assert max_relative_difference(got, _untrained(model)) > 1e-3  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("name, model", [(f[0], f[1]) for f in FIT if f[0] in OFF])
def test_with_masks_drawn_per_rank_the_same_comparison_fails(two_processes, name, model):
    # layer_rng="off": each rank's layers draw from that rank's generator in schedule order, so the
    # masks follow the layout; the test above can fail, and dropout is on.
    got = _state(two_processes / f"{name}_rng_off.ckpt")["state_dict"]
    assert max_relative_difference(got, _reference(model)) > 1e-3


def _forward(two_processes: Path, name: str) -> Dict[str, Any]:
    return torch.load(two_processes / f"{name}.forward.pt", weights_only=False)


@pytest.mark.slow
def test_validation_and_predict_of_a_pytree_model_equal_the_unpipelined_layers(two_processes):
    got = _forward(two_processes, "pytree_forward")
    losses, outputs = unpipelined_outputs("pytree", PytreeForwardModule(dropout=DROPOUT), pytree_loader())
    assert got["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=TOLERANCE)
    assert len(got["predictions"]) == len(outputs)
    for out, expected in zip(got["predictions"], outputs):
        assert out["kind"] == "logits"  # the string leaf crossed the boundary
        torch.testing.assert_close(out["logits"], expected["logits"], rtol=TOLERANCE, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["demo", "gpt2"])
def test_validation_and_predict_of_a_pipeline_of_model_equal_the_unpipelined_model(two_processes, model):
    if not _available(model):
        pytest.skip("transformers is not installed")
    got = _forward(two_processes, f"{model}_forward")
    module, loader = forward_client(model, dropout=DROPOUT)
    losses, outputs = unpipelined_outputs(model, module, loader)
    assert got["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=TOLERANCE)
    assert len(got["predictions"]) == len(outputs)
    for out, expected in zip(got["predictions"], outputs):
        torch.testing.assert_close(out, expected, rtol=TOLERANCE, atol=1e-6)
