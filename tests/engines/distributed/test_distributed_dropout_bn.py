"""The distributed engine with dropout and BatchNorm: two real processes (gloo,
CPU) train the toy module, and each run is held against the local engine or an uninterrupted run.

With per-layer random streams (``layer_rng``, the default) a dropout mask depends on the seed, the
training call, the micro-batch and the layer only, so every distributed layout is held against one
local run on a single stage. One start of two processes runs every training below, one after another
(tests/engines/distributed/distributed_worker.py)."""

import json
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import support.ranks as ranks
from support.toy import ToyModule, assert_bitwise_equal, fit, max_relative_difference, params
from test_distributed_engine import START_S, WORKER, _state
from torch import Tensor

from pipeckpt import PipelineStrategy

STEPS = 4
DROPOUT = 0.3
TOLERANCE = 1e-5  # relative, per tensor: the distributed engine sums micro-batch gradients aside
LAYOUTS = {  # distributed settings; all are held against one local stage
    "gpipe": dict(balance=[3, 3], chunks=4, schedule="gpipe", checkpoint="except_last"),
    "1f1b_mix": dict(balance=[3, 3], chunks=4, schedule="1f1b", checkpoint=["always", "except_last"]),
    "interleaved_mix": dict(
        balance=[2, 1, 1, 2],
        chunks=4,
        schedule="interleaved_1f1b",
        virtual_stages=2,
        checkpoint=["never", "always", "offload", "except_last"],
    ),
}
# Uneven, so that the ranks draw different numbers of random numbers and their generators part.
RESUMED = dict(balance=[2, 4], chunks=4, schedule="1f1b", checkpoint="always")


def _runs() -> list:
    runs = [dict(name=f"dropout_{n}", strategy=s, dropout=DROPOUT, steps=STEPS) for n, s in LAYOUTS.items()]
    for deferred in (False, True):
        runs.append(
            dict(
                name=f"batch_norm{'_deferred' if deferred else ''}",
                strategy=dict(LAYOUTS["1f1b_mix"], deferred_batch_norm=deferred),
                dropout=DROPOUT,
                batch_norm=True,
                steps=STEPS,
            )
        )
    for rng in ("auto", "off"):  # 8 straight steps, and the same run resumed after 4
        strategy = dict(RESUMED, layer_rng=rng)
        runs.append(
            dict(
                name=f"straight_{rng}",
                strategy=strategy,
                dropout=DROPOUT,
                steps=2 * STEPS,
                checkpoint_every=4,
            )
        )
        runs.append(
            dict(
                name=f"resumed_{rng}",
                strategy=strategy,
                dropout=DROPOUT,
                steps=2 * STEPS,
                resume_from=f"straight_{rng}/epoch=0-step={STEPS}.ckpt",
            )
        )
    return runs


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("dropout_bn")
    ranks.launch(WORKER, 2, _runs(), out, within_s=START_S)
    yield out


def _local(steps: int = STEPS, **kwargs: Any) -> Dict[str, Any]:
    module = ToyModule(dropout=DROPOUT, batch_norm=kwargs.pop("batch_norm", False))
    return params(fit(module, PipelineStrategy(chunks=4, **kwargs), steps=steps).lightning_module)


def _floats(state: Dict[str, Tensor]) -> Dict[str, Tensor]:
    return {k: v.double() for k, v in state.items()}


def _seen(out: Path, name: str, rank: int) -> Dict[str, Any]:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropout_training_under_two_processes_matches_one_local_stage(two_processes, layout):
    got = _state(two_processes / f"dropout_{layout}.ckpt")["state_dict"]
    reference = _local(stages=1)
    assert max_relative_difference(got, reference) < TOLERANCE
    assert max_relative_difference(got, ToyModule(dropout=DROPOUT).state_dict()) > 1e-3  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("deferred", [False, True], ids=["per_microbatch", "deferred"])
def test_batch_norm_running_stats_and_parameters_match_the_local_engine(two_processes, deferred):
    name = f"batch_norm{'_deferred' if deferred else ''}"
    got = _floats(_state(two_processes / f"{name}.ckpt")["state_dict"])
    reference = _floats(_local(balance=[3, 3], batch_norm=True, deferred_batch_norm=deferred))
    stats = [k for k in reference if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(stats) == 12  # 4 BatchNorm1d layers, 2 on each rank
    for key in stats:
        assert max_relative_difference({key: got[key]}, {key: reference[key]}) < TOLERANCE, key
    # 4 steps of 4 micro-batches each (deferred: one update per step); shape inference adds none
    assert got["layers.1.1.num_batches_tracked"].item() == (STEPS if deferred else 4 * STEPS)
    assert max_relative_difference(got, reference) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_shape_inference_leaves_batch_norm_running_stats_alone(two_processes, rank):
    # Stage 0 infers shapes on real data, stage 1 on uninitialised tensors: neither may count.
    seen = _seen(two_processes, "batch_norm", rank)
    assert len(seen["batch_norm_at_start"]) == 2  # this rank's two BatchNorm1d layers
    assert seen["batch_norm_at_first_microbatch"] == seen["batch_norm_at_start"]


@pytest.mark.slow
@pytest.mark.parametrize("rng", ["auto", "off"], ids=["layer_streams", "each_ranks_generator"])
def test_a_resumed_run_continues_bitwise_like_an_uninterrupted_one(two_processes, rng):
    # auto: the checkpoint's call count continues the layers' streams; off: each rank's own
    # generator state is restored into that rank (rank 1's is not rank 0's).
    resumed = _state(two_processes / f"resumed_{rng}.ckpt")["state_dict"]
    straight = _state(two_processes / f"straight_{rng}.ckpt")["state_dict"]
    assert_bitwise_equal(resumed, straight)
    halfway = _state(two_processes / f"straight_{rng}" / f"epoch=0-step={STEPS}.ckpt")["state_dict"]
    assert max_relative_difference(straight, halfway) > 1e-3  # the resumed leg trained


@pytest.mark.slow
def test_the_checkpoint_keeps_every_ranks_generator_state_and_the_layer_streams(two_processes):
    state = _state(two_processes / "straight_auto" / f"epoch=0-step={STEPS}.ckpt")["pipeckpt"]
    assert len(state["rng_states"]) == 2
    assert state["layer_rng"] == {"seed": 123, "calls": STEPS}  # rank 0's torch.initial_seed()
