"""Pytrees, side inputs and tied weights under the distributed engine.

Slow tests start 2 real processes (gloo on CPU, tests/engines/distributed/distributed_pytree_worker.py) once
for many
trainings, and compare the trained parameters with the local engine's (pytrees and side inputs: the
local engine is proven against the unpipelined module in test_boundary.py / test_local_pipeline.py) or
with the unpipelined module itself (tied weights), within 1e-5 relative. Dropout on, a mode mix must
leave the distributed training bitwise unchanged, and match the local engine (per-layer streams).
Fast tests check the structure rules without processes.
"""

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import lightning as L
import pytest
import support.ranks as ranks
import torch
from support.pytree_models import PytreeModule, TiedModule, pytree_loader, tied_loader
from support.toy import assert_bitwise_equal, max_relative_difference, params
from support.trainers import QUIET

from pipeckpt import PipeckptConfigError, PipelineStrategy
from pipeckpt.engines.distributed.boundaries import Boundaries
from pipeckpt.state import sharded

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_pytree_worker.py"
START_S = 420  # one group of trainings on a loaded 2-core machine
STEPS = 3

# -- the structure of what crosses a boundary, without processes ----------------------------


def test_a_tensor_output_crosses_as_it_is_and_a_dict_as_its_tensors():
    b = Boundaries()
    t = torch.ones(2, 3)
    assert b.flatten(0, t, inferring=True) is t
    assert b.rebuild(0, (t,)) is t
    h, g = torch.zeros(2, 4), torch.ones(2, 1)
    flat = b.flatten(1, {"h": h, "n": 3, "tag": "x", "none": None, "g": (g,)}, inferring=True)
    assert len(flat) == 2 and flat[0] is h and flat[1] is g  # the dict's tensors, in its order
    again = b.rebuild(1, flat)
    assert again["n"] == 3 and again["tag"] == "x" and again["none"] is None
    assert again["h"] is h and again["g"][0] is g


def test_a_structure_that_changes_after_shape_inference_is_refused_naming_stage_and_values():
    b = Boundaries()
    b.flatten(2, (torch.ones(1), 3), inferring=True)
    b.flatten(2, (torch.zeros(1), 3), inferring=False)  # same structure, other values: fine
    with pytest.raises(
        PipeckptConfigError,
        match=r"(?s)output of pipeline stage 2 \(layers layers.4 to layers.5\) changed from .*3.* to "
        r".*4.*learns the structure.*HINT: .*torch.tensor\(n\)",
    ):
        b.flatten(2, (torch.ones(1), 4), inferring=False, names=("layers.4", "layers.5"))
    with pytest.raises(PipeckptConfigError, match=r"changed from .* to a tensor"):
        b.flatten(2, torch.ones(1), inferring=False)


def test_an_output_without_tensors_is_refused():
    with pytest.raises(PipeckptConfigError, match=r"(?s)output of pipeline stage 0.*holds none.*HINT"):
        Boundaries().flatten(0, {"n": 1}, inferring=True)


# -- real processes --------------------------------------------------------------------------


def _launch(world: int, runs: List[Dict[str, Any]], out: Path) -> Path:
    return ranks.launch(WORKER, world, runs, out, within_s=START_S)


def _state(path: Path) -> Dict[str, Any]:
    single = path.parent / f"{path.name}.pt"
    sharded.to_torch_save(path, single)
    return torch.load(single, map_location="cpu", weights_only=False)


FOUR = dict(balance=[1, 1, 1, 2], chunks=4, virtual_stages=2)
PYTREE = [  # name, distributed settings (2 processes), the local engine's checkpoint setting
    ("gpipe", dict(balance=[2, 3], chunks=4, schedule="gpipe", checkpoint="except_last")),
    ("1f1b_mix", dict(balance=[2, 3], chunks=4, schedule="1f1b", checkpoint=["always", "offload"])),
    (
        "interleaved_mix",
        dict(FOUR, schedule="interleaved_1f1b", checkpoint=["never", "always", "except_last", "offload"]),
    ),
    (
        "looped_bfs_mix",
        dict(FOUR, schedule="looped_bfs", checkpoint=["always", "never", "offload", "always"]),
    ),
    ("interleaved_zero_bubble", dict(FOUR, schedule="InterleavedZeroBubble", checkpoint="never")),
    ("zbv_zero_bubble", dict(FOUR, schedule="zbv_zero_bubble", checkpoint="never")),
    ("dual_pipe_v", dict(FOUR, schedule="DualPipeV", checkpoint="never")),
]
TIED = [  # name, distributed settings, Trainer settings, perturb rank 1's copy
    ("tied_gpipe", dict(balance=[2, 3], chunks=4, schedule="gpipe", checkpoint="except_last"), {}, True),
    (
        "tied_1f1b_clip_accumulate",
        dict(balance=[2, 3], chunks=4, schedule="1f1b", checkpoint="always"),
        dict(gradient_clip_val=0.05, accumulate_grad_batches=2),
        False,
    ),
    (
        "tied_interleaved",
        dict(FOUR, schedule="interleaved_1f1b", checkpoint=["always", "never", "offload", "except_last"]),
        {},
        False,
    ),
    # V-shape: stages 0 and 3 both on rank 0, the tie never leaves the process.
    ("tied_zbv", dict(FOUR, schedule="zbv_zero_bubble", checkpoint="never"), {}, False),
]
DROPOUT = dict(balance=[2, 3], chunks=4, schedule="1f1b")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    runs: List[Dict[str, Any]] = [dict(name=n, model="pytree", strategy=s, steps=STEPS) for n, s in PYTREE]
    runs[0]["validate"] = True
    for name, settings, trainer, perturb in TIED:
        runs.append(
            dict(name=name, model="tied", strategy=settings, steps=STEPS, perturb_tie=perturb, **trainer)
        )
    for modes in ("never", ["always", "except_last"]):
        tag = "never" if modes == "never" else "mix"
        runs.append(
            dict(
                name=f"dropout_{tag}",
                model="pytree",
                strategy=dict(DROPOUT, checkpoint=modes),
                dropout=0.3,
                steps=STEPS,
            )
        )
    yield _launch(2, runs, tmp_path_factory.mktemp("pytree"))


def _fit(module: L.LightningModule, strategy: Any, loader: Any, **kwargs: Any) -> L.Trainer:
    torch.manual_seed(123)
    settings: Dict[str, Any] = dict(
        devices=1,
        max_steps=STEPS,
        **QUIET,
    )
    trainer = L.Trainer(strategy=strategy, **{**settings, **kwargs})
    trainer.fit(module, loader)
    return trainer


def _local(settings: Dict[str, Any]) -> PipelineStrategy:
    return PipelineStrategy(
        balance=settings["balance"], chunks=settings["chunks"], checkpoint=settings["checkpoint"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("name, settings", PYTREE, ids=[p[0] for p in PYTREE])
def test_dicts_tuples_and_side_inputs_train_like_the_local_engine(two_processes, name, settings):
    reference = _fit(PytreeModule(), _local(settings), pytree_loader())
    got = _state(two_processes / f"{name}.ckpt")["state_dict"]
    assert sorted(got) == sorted(params(reference.lightning_module))
    assert max_relative_difference(got, params(reference.lightning_module)) < 1e-5


@pytest.mark.slow
def test_a_forward_only_step_sees_the_pytree_output_of_the_whole_batch(two_processes):
    reference = _fit(PytreeModule(), _local(PYTREE[0][1]), pytree_loader(), limit_val_batches=1.0)
    reference.validate(reference.lightning_module, pytree_loader(), verbose=False)
    seen = json.loads((two_processes / "gpipe.rank0.json").read_text())["metrics"]
    assert seen["val_loss"] == pytest.approx(float(reference.callback_metrics["val_loss"]), rel=1e-5)


@pytest.mark.slow
def test_every_recompute_of_a_side_input_stage_runs_with_its_side_inputs(two_processes):
    calls: Dict[str, int] = {}
    for rank in range(2):
        calls.update(json.loads((two_processes / f"1f1b_mix.rank{rank}.json").read_text())["forward_calls"])
    # STEPS steps of 4 micro-batches: `always` and `offload` recompute all 4.
    assert calls == {"0": STEPS * 8, "1": STEPS * 8}


@pytest.mark.slow
@pytest.mark.parametrize("name, settings, trainer, perturb", TIED, ids=[t[0] for t in TIED])
def test_a_weight_tied_across_processes_trains_like_the_unpipelined_model(
    two_processes, name, settings, trainer, perturb
):
    reference = _fit(TiedModule(), "auto", tied_loader(), **trainer)
    got = _state(two_processes / f"{name}.ckpt")["state_dict"]
    assert max_relative_difference(got, params(reference.lightning_module)) < 1e-5


@pytest.mark.slow
def test_a_tied_weights_checkpoint_holds_the_unpipelined_keys_and_loads_strictly(two_processes):
    got = _state(two_processes / "tied_gpipe.ckpt")
    plain = TiedModule(seed=5)
    assert sorted(got["state_dict"]) == sorted(plain.state_dict())  # both keys the module itself has
    torch.testing.assert_close(
        got["state_dict"]["layers.0.weight"], got["state_dict"]["layers.4.embedding.weight"], rtol=0, atol=0
    )
    plain.load_state_dict(got["state_dict"], strict=True)
    assert plain.layers[0].weight is plain.layers[4].embedding.weight  # still one parameter
    assert len(got["optimizer_states"][0]["state"]) == len(list(plain.parameters()))


@pytest.mark.slow
def test_recompute_with_side_inputs_leaves_dropout_training_bitwise_unchanged(two_processes):
    never = _state(two_processes / "dropout_never.ckpt")["state_dict"]
    mix = _state(two_processes / "dropout_mix.ckpt")["state_dict"]
    assert_bitwise_equal(mix, never)
    assert max_relative_difference(never, PytreeModule(dropout=0.3).state_dict()) > 1e-3  # it trained


@pytest.mark.slow
def test_with_dropout_on_pytrees_and_side_inputs_train_like_the_local_engine(two_processes):
    # Per-layer random streams (pipeckpt.checkpointing.layer_rng): the masks do not depend on the engine.
    settings = dict(DROPOUT, checkpoint=["always", "except_last"])
    reference = _fit(PytreeModule(dropout=0.3), _local(settings), pytree_loader())
    got = _state(two_processes / "dropout_mix.ckpt")["state_dict"]
    assert max_relative_difference(got, params(reference.lightning_module)) < 1e-5
